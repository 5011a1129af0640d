"""The local backend: every rank a process on this machine, fresh or forked from the warm starter.

The flow of one call here::

    LocalBackend.prepare(settings)  the warm starter on its way (warm mode); the accelerator plan
    LocalBackend.run(request, bus)
      RunStarted, as the log folder is made
      local_call.LocalCall (the one call loop, backends/call_loop.py, run in this thread):
        1. the rendezvous store on 127.0.0.1, port chosen by the kernel (rendezvous.py)
        2. one rank group (rank_group.py): a private call folder (0700) with launch.json and
           the payload, one process per rank (a fork of the ready starter, or a fresh
           ``sys.executable``), watched until the end, stopped, the folder removed
        3. the outcome, from the ledger (outcome/ledger.py)
    LocalBackend.stop()             from any thread: the loop stops every rank, as on Ctrl-C

Two modes behind one class: ``warm_start=True`` (``local-warm``) forks ranks from
the starter when it is ready and starts fresh ones otherwise; ``warm_start=False``
(``local-fresh``) always starts fresh interpreters.
"""

from __future__ import annotations

from air_magic import private_files
from air_magic.backends.local.local_call import LocalCall
from air_magic.launch.accelerators import AcceleratorPlan, plan_accelerators
from air_magic.launch.request import LaunchRequest, RunResult, StopRequest
from air_magic.launch.settings import LaunchSettings
from air_magic.node import warm
from air_magic.node.open_files import refuse_beyond_the_hard_limit
from air_magic.protocol.events import EventBus


class LocalBackend:
    """Runs every rank as a local process: forked from the warm starter, or a fresh interpreter."""

    def __init__(self, warm_start: bool = True):
        self.warm_start = warm_start
        self.name = "local-warm" if warm_start else "local-fresh"
        self._stop_requested = StopRequest()
        self._loop: LocalCall | None = None  # the call in progress, for stacks()

    def prepare(self, settings: LaunchSettings) -> AcceleratorPlan:
        if self.warm_start:
            # First: the starter imports torch while this process does its own imports. The call's
            # env= may hold start-up variables (PYTHONHASHSEED...), which the starter must start with.
            warm.prestart(settings.log_dir, settings.env, tracked=settings.tracking)
        self._stop_requested.clear()  # here, not in run(): a stop() between the two still counts
        plan = plan_accelerators(settings.num_accelerators, settings.accelerator_type)
        refuse_beyond_the_hard_limit(plan.world_size)
        return plan

    def run(self, request: LaunchRequest, bus: EventBus) -> RunResult:
        # A caller killed mid-call (SIGKILL) cannot remove its folders: the arguments in clear.
        private_files.sweep_dead_callers()
        loop = LocalCall(
            request,
            bus,
            warm_start=self.warm_start,
            stop_requested=self._stop_requested,
        )
        self._loop = loop
        try:
            return loop.execute()
        finally:
            self._loop = None

    def stop(self, grace_s: float | None = None, signum: int | None = None) -> None:
        self._stop_requested.ask(grace_s, signum)

    def stacks(self) -> dict[int, str]:
        loop = self._loop
        return loop.stacks() if loop is not None else {}
