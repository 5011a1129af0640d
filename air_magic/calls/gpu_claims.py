"""Which GPUs the running calls of this process hold, so that a second call on them is refused.

Only a background run (``calls/background.py``) lets a process start a call
while another runs; a detached run (``calls/detached.py``) holds its GPUs for
every process of the user (its state file names them). Two trainings on one GPU
compete for its memory and time: usually one fails out of memory minutes later,
or both crawl. A call whose plan
overlaps the GPUs of a running call is therefore refused before anything
starts, with what to do, unless ``share_gpus=True``. CPU ranks claim nothing.
"""

from __future__ import annotations

import itertools
import threading

from air_magic.errors import ConfigurationError
from air_magic.launch.accelerators import AcceleratorPlan

_lock = threading.Lock()
_held: dict[int, tuple[str, frozenset[str], frozenset[str]]] = {}  # claim -> (name, GPU uuids, shown)
_ids = itertools.count(1)


def claim(name: str, plan: AcceleratorPlan, share: bool) -> int | None:
    """Hold ``plan``'s GPUs for the call ``name``; refuse if a running call holds one of them.

    Returns the claim to :func:`release` when the call ends (None: nothing held).
    """
    if plan.cpu_mode:
        return None
    uuids = frozenset(g.uuid for g in plan.gpus)
    shown = frozenset(str(g.index) for g in plan.gpus)
    with _lock:
        if not share:
            for other_name, other_uuids, other_shown in _held.values():
                if uuids & other_uuids:
                    both = ", ".join(sorted(shown & other_shown)) or ", ".join(sorted(other_shown))
                    raise ConfigurationError(
                        f"{name} would run on GPU {both}, which {other_name} (running in the background, "
                        "or on another thread of this process) is using. Wait for it (handle.result()), "
                        "cancel it (handle.cancel()), give this call other GPUs (num_accelerators=, "
                        "CUDA_VISIBLE_DEVICES), or pass share_gpus=True (--share-gpus) to run both "
                        "on them. Nothing was started."
                    )
        if not share:
            from air_magic.calls import detached  # other kernels' runs: their supervisors' state

            for uuid, holder in detached.live_gpu_uuids().items():
                if uuid in uuids:
                    index = next(str(g.index) for g in plan.gpus if g.uuid == uuid)
                    raise ConfigurationError(
                        f"{name} would run on GPU {index}, which {holder} is using. Wait for it, "
                        "cancel it (air_magic.attach(...).cancel()), give this call other GPUs, or pass "
                        "share_gpus=True (--share-gpus) to run both on them. Nothing was started."
                    )
        token = next(_ids)
        _held[token] = (name, uuids, shown)
        return token


def release(token: int | None) -> None:
    """The call that made this claim has ended (every rank reaped)."""
    if token is not None:
        with _lock:
            _held.pop(token, None)
