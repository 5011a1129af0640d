"""The local backend: every rank a process on this machine, fresh or forked from the warm starter.

The flow of one call here::

    LocalBackend.prepare(settings)  the warm starter on its way (warm mode); the accelerator plan
    LocalBackend.run(request, bus)
      1. a private call folder (0700): launch.json + payload.pkl, written once (protocol/wire.py)
      2. the rendezvous store on 127.0.0.1, port chosen by the kernel (rendezvous.py)
      3. call_loop.CallLoop: one process per rank (a fork of the ready starter, or a fresh
         ``sys.executable``), watched until the end, stopped, the outcome built
      4. the call folder is removed
    LocalBackend.stop()             from any thread: the loop stops every rank, as on Ctrl-C

Two modes behind one class: ``warm_start=True`` (``local-warm``) forks ranks from
the starter when it is ready and starts fresh ones otherwise; ``warm_start=False``
(``local-fresh``) always starts fresh interpreters.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

from air_magic import private_files
from air_magic.backends.local import warm
from air_magic.backends.local.call_loop import CallLoop, CallPlace
from air_magic.backends.local.rendezvous import RendezvousStore
from air_magic.backends.output import make_log_dir
from air_magic.errors import LaunchError
from air_magic.launch.accelerators import AcceleratorPlan, plan_accelerators
from air_magic.launch.request import LaunchRequest, RunResult, StopRequest, new_run_id
from air_magic.launch.settings import LaunchSettings
from air_magic.protocol import wire
from air_magic.protocol.events import EventBus, RunFinished, RunStarted


class LocalBackend:
    """Runs every rank as a local process: forked from the warm starter, or a fresh interpreter."""

    def __init__(self, warm_start: bool = True):
        self.warm_start = warm_start
        self.name = "local-warm" if warm_start else "local-fresh"
        self._stop_requested = StopRequest()
        self._loop: CallLoop | None = None  # the call in progress, for stacks()

    def prepare(self, settings: LaunchSettings) -> AcceleratorPlan:
        if self.warm_start:
            # First: the starter imports torch while this process does its own imports. The call's
            # env= may hold start-up variables (PYTHONHASHSEED...), which the starter must start with.
            warm.prestart(settings.log_dir, settings.env, tracked=settings.tracking)
        self._stop_requested.clear()  # here, not in run(): a stop() between the two still counts
        return plan_accelerators(settings.num_accelerators, settings.accelerator_type)

    def run(self, request: LaunchRequest, bus: EventBus) -> RunResult:
        # A caller killed mid-call (SIGKILL) cannot remove its folders: the arguments in clear.
        private_files.sweep_dead_callers()
        run_id = request.run_id or new_run_id()
        log_dir = make_log_dir(request.log_root, run_id)
        plan = request.plan
        started = time.monotonic()
        # At once: the folder's run.json says what runs from its first moment (`air-magic runs`).
        bus.emit(
            RunStarted(
                run_id=run_id,
                world_size=plan.world_size,
                backend=plan.backend,
                detected=plan.detected,
                cpu_mode=plan.cpu_mode,
                log_dir=log_dir,
                name=request.name,
            )
        )

        def ended_before_the_loop(outcome: str, error: BaseException) -> None:
            elapsed = time.monotonic() - started
            bus.emit(RunFinished(run_id, outcome, elapsed, log_dir, f"{type(error).__name__}: {error}"))

        if self._stop_requested.is_set():  # stopped before a rank started (a script's end): nothing to start
            error = LaunchError(f"{request.name} was stopped before it finished; every rank is gone")
            ended_before_the_loop("interrupted", error)
            return RunResult(run_id, log_dir, "interrupted", error=error)
        executing = False  # from then on the loop says how the call ended
        try:
            run_dir = private_files.private_tempdir(run_id)  # 0700, named after this caller for the sweep
            try:
                write_call_files(run_dir, request.payload)
                store = RendezvousStore(plan.world_size)  # may import torch: seconds
                try:
                    place = CallPlace(run_id, run_dir, log_dir, store.port)
                    loop = CallLoop(
                        request, bus, place, warm_start=self.warm_start, stop_requested=self._stop_requested
                    )
                    self._loop = loop
                    try:
                        executing = True
                        return loop.execute()
                    finally:
                        self._loop = None
                finally:
                    store.close()
            finally:
                shutil.rmtree(run_dir, ignore_errors=True)
        except BaseException as exc:
            if not executing:  # stopped or failed while starting: still recorded as ended
                ended_before_the_loop("interrupted" if isinstance(exc, KeyboardInterrupt) else "failed", exc)
            raise

    def stop(self, grace_s: float | None = None, signum: int | None = None) -> None:
        self._stop_requested.ask(grace_s, signum)

    def stacks(self) -> dict[int, str]:
        loop = self._loop
        return loop.stacks() if loop is not None else {}


def write_call_files(run_dir: str, payload: bytes) -> None:
    """The call folder's two inputs: the caller's ``sys.path`` and ``argv``, and the payload."""
    launch = {"sys_path": list(sys.path), "argv": list(sys.argv) or [""]}
    wire.write_atomically(os.path.join(run_dir, wire.LAUNCH_FILE), json.dumps(launch).encode())
    wire.write_atomically(os.path.join(run_dir, wire.PAYLOAD_FILE), payload)
