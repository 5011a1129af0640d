"""Inside a rank: a framework's own process launcher fails at once instead of hanging.

Lightning's ``ddp_spawn``, ``ddp_fork`` and ``ddp_notebook`` strategies (a ``Trainer``
or ``Fabric``) start one process per device themselves. Inside a rank that air_magic
started, each of those children inherits the rank's ``RANK``, ``WORLD_SIZE`` and
``MASTER_PORT``: they join the group as duplicates of one rank and wait for ever.
Under torchrun the same script hangs too (tried: ``ddp_spawn`` and ``ddp_fork`` until
killed). The processes are already there, one per device, so the right strategy is
``"ddp"``: Lightning then joins air_magic's ranks, as it joins torchrun's. Registered
with ``worker/post_import.py``: patched only if and when the rank imports Lightning.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Any

from air_magic.worker import post_import

# Lightning's strategies that start processes of their own, by the start method they use.
_STRATEGIES = {
    "spawn": '"ddp_spawn"',
    "fork": '"ddp_fork" / "ddp_notebook"',
    "forkserver": '"ddp_forkserver"',
}


def install() -> None:
    post_import.register(
        {
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
    launcher_class = module._MultiProcessingLauncher
    original = launcher_class.launch

    @functools.wraps(original)
    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        method = getattr(self, "_start_method", "spawn")
        strategy = _STRATEGIES.get(method, f"a strategy starting processes by {method!r}")
        raise StrategyStartsProcesses(
            f"Lightning's strategy {strategy} starts processes of its own, but this process is "
            f"already rank {os.environ.get('RANK')} of {os.environ.get('WORLD_SIZE')} that air_magic "
            'started (one per device): use strategy="ddp", which joins these ranks as it joins '
            "torchrun's. (Those processes would share this rank's RANK and wait for ever.)"
        )

    launcher_class.launch = launch
