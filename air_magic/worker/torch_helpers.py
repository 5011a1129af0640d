"""Helpers for code running inside a rank (optional: plain torch code works unchanged)."""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any

from air_magic.protocol import env_names


def init_process_group(
    backend: str | None = None,
    *,
    timeout: float | datetime.timedelta | None = None,
    tf32: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Initialise torch.distributed for this rank and return its ``torch.device``.

    Picks ``nccl`` and ``cuda:LOCAL_RANK`` when the launch planned GPUs, ``gloo``
    and the CPU otherwise, so the same function runs on a GPU node and a laptop.

    - ``timeout``: seconds (or a ``timedelta``) a collective may wait before it fails;
      default torch's (10 minutes for NCCL, 30 for gloo).
    - ``tf32``: ``True`` lets float32 matrix products and convolutions use TF32 on Ampere and
      newer GPUs (faster, 10-bit mantissa), ``False`` forbids it, ``None`` (default) leaves
      torch's setting as it is. Opt-in, because it changes results.

    Extra keyword arguments go to ``torch.distributed.init_process_group``.
    """
    import torch
    import torch.distributed as dist

    if timeout is not None:
        kwargs["timeout"] = (
            timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
        )
    if tf32 is not None:
        torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
        torch.backends.cudnn.allow_tf32 = bool(tf32)

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = os.environ.get(env_names.DEVICE, "cuda" if torch.cuda.is_available() else "cpu") == "cuda"
    if on_gpu:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        kwargs.setdefault("device_id", device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if on_gpu else "gloo"), **kwargs)
    elif (session_rank := sys.modules.get("air_magic.worker.session_rank")) is not None:
        # In a session (only there does it warn) the session's group is kept, whatever is asked.
        session_rank.say_what_is_kept(backend, kwargs.get("timeout"), stacklevel=2)
    return device
