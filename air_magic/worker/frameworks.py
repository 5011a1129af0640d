"""Inside a rank: what air_magic adapts in the frameworks a rank imports (none is imported here).

**A framework's own process launcher fails at once instead of hanging.** Lightning's
``ddp_spawn``, ``ddp_fork`` and ``ddp_notebook`` strategies (a ``Trainer`` or ``Fabric``)
start one process per device themselves. Inside a rank that air_magic started, each of those
children inherits the rank's ``RANK``, ``WORLD_SIZE`` and ``MASTER_PORT``: they join the group
as duplicates of one rank and wait for ever. Under torchrun the same script hangs too (tried:
``ddp_spawn`` and ``ddp_fork`` until killed). The processes are already there, one per device,
so the right strategy is ``"ddp"``: Lightning then joins air_magic's ranks, as it joins
torchrun's.

**In a persistent session, a cell may build a new Accelerate ``Accelerator``.** Accelerate
keeps one state per process (``AcceleratorState``, ``GradientState``: shared dicts), made by
the first ``Accelerator``; a later one with another ``mixed_precision`` raises "AcceleratorState
has already been initialized ... restart your runtime", and one with other plugins silently
keeps the first one's. A session rank runs cell after cell in one process, where a user expects
what a new call gives: so the first ``Accelerator`` built in a later cell starts from a fresh
state. The old state's dict is replaced, not cleared: objects of the earlier cells (an
``Accelerator``, its prepared optimizer and data loaders) keep theirs and still work; Accelerate's
helpers that look the state up afresh see the newest, as in one script that builds a second
``Accelerator``. ``PartialState`` (rank, device, process group) is kept, with the distributed
type it found for the process (an FSDP or DeepSpeed plugin overwrites that in its dict).
Within a cell, as within a one-off call, Accelerators share the state as Accelerate intends.

Both are registered with ``worker/post_import.py``: patched only if and when the rank imports
the framework.
"""

from __future__ import annotations

import functools
import os
import sys
from types import ModuleType
from typing import Any

from air_magic.worker import post_import

# Lightning's strategies that start processes of their own, by the start method they use.
_STRATEGIES = {
    "spawn": '"ddp_spawn"',
    "fork": '"ddp_fork" / "ddp_notebook"',
    "forkserver": 'DDPStrategy(start_method="forkserver")',
}


_cell = 0  # the session cell running (0: a one-off call, one cell)


def new_cell() -> None:
    """A session rank starts its next cell."""
    global _cell
    _cell += 1


def install() -> None:
    """Register the patches (applied when, and if, the rank imports each module)."""
    post_import.register(
        {
            "accelerate.state": _remember_the_process_state,
            "accelerate.accelerator": _fresh_accelerate_state_per_cell,
            # The ``lightning`` package and the older standalone ones ship the same launcher.
            "lightning.pytorch.strategies.launchers.multiprocessing": _refuse_to_start_processes,
            "lightning.fabric.strategies.launchers.multiprocessing": _refuse_to_start_processes,
            "pytorch_lightning.strategies.launchers.multiprocessing": _refuse_to_start_processes,
            "lightning_fabric.strategies.launchers.multiprocessing": _refuse_to_start_processes,
        }
    )


class StrategyStartsProcesses(RuntimeError):
    """A framework strategy that would start processes of its own inside an air_magic rank."""


def _refuse_to_start_processes(module: ModuleType) -> None:
    """Make Lightning's ``_MultiProcessingLauncher.launch`` raise, before it starts anything."""
    launcher_class = module._MultiProcessingLauncher
    original = launcher_class.launch

    @functools.wraps(original)
    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        method = getattr(self, "_start_method", "spawn")
        strategy = _STRATEGIES.get(method, f"a strategy starting processes by {method!r}")
        raise StrategyStartsProcesses(
            f"Lightning's strategy {strategy} starts processes of its own, but this process is "
            f"already rank {os.environ.get('RANK')} of {os.environ.get('WORLD_SIZE')} that air_magic "
            'started (one per device): use strategy="ddp" (or "ddp_find_unused_parameters_true"), '
            "which joins these ranks as it joins torchrun's. (Those processes would share this "
            "rank's RANK and wait for ever.)"
        )

    launcher_class.launch = launch


# What PartialState itself found for this process (DistributedType.MULTI_CPU, MULTI_GPU...): an
# Accelerator with a plugin (FSDP, DeepSpeed, Megatron) overwrites it in PartialState's dict.
_process_distributed_type: list[Any] = []


def _remember_the_process_state(module: ModuleType) -> None:
    """Wrap ``PartialState.__init__``: note the distributed type it finds, the first time."""
    partial_class = module.PartialState
    original = partial_class.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if not _process_distributed_type and getattr(self, "distributed_type", None) is not None:
            _process_distributed_type.append(self.distributed_type)

    partial_class.__init__ = __init__


def _fresh_accelerate_state_per_cell(module: ModuleType) -> None:
    """Wrap ``Accelerator.__init__``: the first one of a later session cell starts afresh."""
    accelerator_class = module.Accelerator
    original = accelerator_class.__init__
    made_in: list[int] = []  # the cell whose Accelerator made the current state

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if made_in and made_in[-1] != _cell:
            _replace_state(sys.modules["accelerate.state"])
        original(self, *args, **kwargs)
        made_in[:] = [_cell]

    accelerator_class.__init__ = __init__


def _replace_state(state: ModuleType) -> None:
    """New, empty shared dicts for AcceleratorState and GradientState; PartialState as it found itself."""
    for name in ("AcceleratorState", "GradientState"):
        holder = getattr(state, name)
        shared = holder.__dict__.get("_shared_state")
        if type(shared) is dict:
            holder._shared_state = {}
        else:  # Accelerate's thread-local descriptor (TPUs): its storage, the descriptor kept
            shared._storage = {}
    if _process_distributed_type:
        state.PartialState._shared_state["distributed_type"] = _process_distributed_type[0]
