"""Where this rank stands: rank, local rank, world size, node, for code running inside a call.

    from air_magic import runtime
    if runtime.get_rank() == 0:
        save(model)

The values come from the torchrun-style variables every rank gets
(``launch/rank_env.py``). When ``torch.distributed`` is initialised they are
checked against it, and a disagreement is an error (a process group made with
other numbers than the launch's is a bug that hangs collectives later).
Outside a call (the notebook itself, a plain ``python``) the world is one
process: rank 0 of 1. Importing this module, or calling these, never imports torch.
"""

from __future__ import annotations

import os
import sys


def get_rank() -> int:
    """This rank's global rank (``RANK``); 0 outside a call."""
    return _checked("RANK", 0, "get_rank")


def get_world_size() -> int:
    """How many ranks the call has (``WORLD_SIZE``); 1 outside a call."""
    return _checked("WORLD_SIZE", 1, "get_world_size")


def get_local_rank() -> int:
    """This rank's index on its machine (``LOCAL_RANK``, its GPU's index); 0 outside a call."""
    return _env_int("LOCAL_RANK", 0)


def get_local_world_size() -> int:
    """How many ranks run on this machine (``LOCAL_WORLD_SIZE``); 1 outside a call."""
    return _env_int("LOCAL_WORLD_SIZE", 1)


def get_node_rank() -> int:
    """This machine's index among the call's machines (``NODE_RANK``); 0 on one machine."""
    return _env_int("NODE_RANK", _env_int("GROUP_RANK", 0))


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise RuntimeError(f"air_magic.runtime: {name}={text!r} is not an integer") from None


def _checked(name: str, default: int, getter: str) -> int:
    value = _env_int(name, default)
    dist = sys.modules.get("torch.distributed")  # never imported here: only if the rank did
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return value
    actual = int(getattr(dist, getter)())
    if name in os.environ and actual != value:
        raise RuntimeError(
            f"air_magic.runtime.{getter}(): torch.distributed says {actual} but the launch set "
            f"{name}={value}; the process group was initialised with other numbers than the launch's"
        )
    return actual
