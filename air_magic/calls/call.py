"""The call layer: the one place that picks a backend for a call and wires its consumers.

The surfaces (``decorator.py``, ``notebook/magics.py``, ``cli.py``) come here with a function,
its bound arguments and validated settings::

    run_call(name, func, bound, settings)
      1. refuse a call from inside a rank
      2. runners.runner_for(settings)     where it runs (calls/runners.py, the one place that decides
                                          detached): here on the local backend, warm or fresh, or the
                                          Ray backend; or under a supervisor of its own
      3. backend.prepare(settings)        starts what is slow to start; the accelerator plan
      4. build_payload(...)               cloudpickle once; an unpicklable part fails here, named
      5. tracking.TrackedRunOwner(...).wait()    the call's MLflow run (its variables go to every rank)
      6. consumers: history, the display, the tracked run; one EventBus
      7. backend.run(request, bus)        -> RunResult (values in rank order, or the error)
      8. the tracked run ends with the call's outcome (in a ``finally``: even on Ctrl-C)
"""

from __future__ import annotations

import atexit
import inspect
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from air_magic.backends.base import Backend
from air_magic.calls import gpu_claims, runners
from air_magic.calls.history import RunHistory
from air_magic.display.widgets import make_consumers
from air_magic.errors import ConfigurationError
from air_magic.launch.accelerators import AcceleratorPlan
from air_magic.launch.payload import build_payload
from air_magic.launch.request import CellChannel, LaunchRequest, RunResult
from air_magic.launch.settings import LaunchSettings, stop_grace_s
from air_magic.node import warm
from air_magic.protocol import env_names
from air_magic.protocol.events import Consumer, EventBus, Outcome
from air_magic.tracking import run as tracking

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11 (we support 3.10)


class CallOrigin(TypedDict, total=False):
    """What a call is besides its function, as :func:`prepare_call` takes it (``kind``: 'function',
    'cell', 'script', ...; ``source``: a cell's text; ``backend``: default
    the runner's, ``calls/runners.runner_for``)."""

    kind: str
    source: str | None
    backend: Backend | None


def run_call(
    name: str,
    func: Callable[..., Any],
    bound: inspect.BoundArguments,
    settings: LaunchSettings,
    *,
    consumers: Sequence[Consumer] = (),
    **origin: Unpack[CallOrigin],
) -> RunResult:
    """Plan, pack, track and run one call (``origin``: :class:`CallOrigin`, :func:`prepare_call`'s).

    ``consumers``: more consumers of the call's events, beside the display that
    ``settings.display`` names (the command line's JSON lines, say).
    """
    prepared = prepare_call(name, func, bound, settings, **origin)
    return prepared.runner.run(prepared, consumers)


def start_async(
    prepared: PreparedCall,
    on_result: Callable[[RunResult], Any] | None = None,
    consumers: Sequence[Consumer] = (),
) -> Any:
    """Start a prepared call and return its handle at once: in a thread of this process, or under
    a supervisor of its own (``detach=True``): its runner's (``calls/runners.py``)."""
    try:
        return prepared.runner.start(prepared, on_result, consumers)
    except BaseException:
        prepared.abandon()  # nothing was left running: its GPUs are free again (a no-op if given back)
        raise


def prepare_call(
    name: str,
    func: Callable[..., Any],
    bound: inspect.BoundArguments,
    settings: LaunchSettings,
    *,
    kind: str = "function",
    source: str | None = None,
    backend: Backend | None = None,
    background: bool = False,
) -> PreparedCall:
    """Steps 1-5 up to the wait for the MLflow run: everything that can refuse the call, on the
    caller's thread (a background call raises here, before its handle exists)."""
    inside = os.environ.get(env_names.CALL_ID)
    if inside:
        raise ConfigurationError(
            f"{name}.distributed() was called inside rank {os.environ.get('RANK', '?')} of run {inside}: "
            "a rank cannot start ranks of its own. Call the function directly there (fn.func(...))."
        )
    try:
        os.getcwd()
    except FileNotFoundError:  # torch itself fails to load there (a bare "oneMKL FATAL ERROR")
        raise ConfigurationError(
            f"{name}: this process's working folder no longer exists (it was deleted after this "
            "kernel or script started in it); ranks start in the caller's folder. Change to one that "
            "exists first (%cd ~ in a notebook, os.chdir(...)); nothing was launched."
        ) from None
    runner = runners.runner_for(settings, backend)
    plan, backend = runner.prepare(settings)
    try:
        payload = build_payload(func, bound, settings.max_payload_bytes)
        # The last check, on the caller's thread: from here the GPUs are this call's until run() ends.
        claim = gpu_claims.claim(name, plan, settings.share_gpus)
    except BaseException:
        _release(backend)
        raise
    run_owner = facts = None
    if settings.tracking:
        facts = tracking.CallFacts(
            name=name,
            kind=kind,
            source=source if source is not None else _source_of(func),
            plan=plan,
            timeout=settings.timeout,
            accelerator_type=settings.accelerator_type.name if settings.accelerator_type else None,
            experiment=settings.experiment,
            run_name=settings.run_name,
            resume_run_id=settings.mlflow_run_id,
            system_metrics=settings.system_metrics,
            hidden=tuple(settings.env.values()),  # never recorded (a secret's place in the source)
        )
        run_owner = tracking.TrackedRunOwner(facts, log_root=settings.log_dir)
        run_owner.remember_active()
    return PreparedCall(name, settings, backend, plan, payload, run_owner, claim, runner, facts, kind)


@dataclass
class PreparedCall:
    """A call that passed every check, its payload packed and its MLflow run on its way."""

    name: str
    settings: LaunchSettings
    backend: Backend | None  # what starts the ranks from this process (None: a Ray job's supervisor)
    plan: AcceleratorPlan
    payload: bytes
    run_owner: tracking.TrackedRunOwner | None
    claim: int | None  # the GPUs this call holds (gpu_claims), released when run() ends
    runner: runners.Runner  # where and how long it runs (calls/runners.py)
    # What its MLflow run records (a detached run's supervisor creates the run from it).
    facts: tracking.CallFacts | None = None
    kind: str = "function"  # 'function' or 'cell'; from the command line also 'script' or 'module'
    call_id: str | None = None  # the call's id if chosen before it runs (a detached run's); else backend's
    channel: CellChannel | None = None  # a persistent session's pipes to its ranks (calls/persistent.py)

    def displays(self) -> list[Consumer]:
        """The display that ``settings.display`` names (built on the caller's thread: a background
        call shows its tabs in the cell that started it, before the cell ends)."""
        return make_consumers(self.settings.display)

    def abandon(self) -> None:
        """Its GPUs are free again (the call will not run here after all, or it has ended): this
        process's claim, and what the backend reserved for it in prepare(). Safe to call twice."""
        claim, self.claim = self.claim, None
        gpu_claims.release(claim)
        _release(self.backend)

    def run(self, displays: Sequence[Consumer], consumers: Sequence[Consumer] = ()) -> RunResult:
        """Steps 5-8: wait for the tracked run, run the ranks, end the tracked run with the outcome."""
        run_owner = self.run_owner
        outcome = Outcome.INTERRUPTED
        # The run is made inside the try: an interrupt at any moment from here on (even while the
        # run is being created, on TrackedRunOwner's thread) ends it KILLED, never left RUNNING.
        try:
            tracked = run_owner.wait() if run_owner is not None else None
            record = tracked.link() if tracked is not None else None
            request = LaunchRequest(
                name=self.name,
                payload=self.payload,
                plan=self.plan,
                timeout=self.settings.timeout,
                stop_grace=stop_grace_s(self.settings.stop_grace),
                exit_zero_succeeds=self.kind in ("script", "module"),
                env={**_mlflow_env(run_owner, tracked), **self.settings.env},
                log_root=self.settings.log_dir,
                call_id=self.call_id,
                channel=self.channel,
            )
            wired: list[Consumer] = [RunHistory(), *displays, *consumers]
            if tracked is not None:
                wired.append(tracked)
            bus = EventBus(wired)
            if record is not None:  # the first event: every consumer knows the run before a rank
                bus.emit(record)
            assert self.backend is not None, f"{self.name} runs elsewhere ({self.runner})"
            result = self.backend.run(request, bus)
            outcome = result.outcome
            return result
        except KeyboardInterrupt:
            raise
        except BaseException:
            outcome = Outcome.FAILED
            raise
        finally:
            self.abandon()
            if run_owner is not None:
                run_owner.end(outcome)


def _mlflow_env(
    run_owner: tracking.TrackedRunOwner | None, tracked: tracking.TrackedRun | None
) -> dict[str, str]:
    """The ranks' MLflow variables: the tracked run's, or, when the call runs untracked, a store
    that cannot keep their own MLflow calls waiting on the one that failed."""
    if tracked is not None:
        return tracked.env
    return dict(run_owner.untracked_env) if run_owner is not None else {}


def _release(backend: Backend | None) -> None:
    """What ``backend.prepare`` reserved for the call (the Ray backend's pool), given back."""
    release = getattr(backend, "release", None)
    if release is not None:
        release()


def _source_of(func: Callable[..., Any]) -> str | None:
    try:
        return inspect.getsource(func)
    except (OSError, TypeError):
        return None


_exit_hooks: list[Callable[[], None]] = []


def on_exit(hook: Callable[[], None]) -> None:
    """Run ``hook`` at the interpreter's exit, after background runs stop and before the warm starter
    does (a layer above registers here: this module does not import it)."""
    if hook not in _exit_hooks:
        _exit_hooks.append(hook)


@atexit.register
def _at_exit() -> None:
    """An orderly exit mid-call (kernel shutdown or restart): background runs are cancelled (each
    ends as an interrupt would end it), then every rank left stops, then the tracked runs end
    KILLED, with their logs complete. Registered here, in that order, not left to the order in
    which the modules happened to be imported (atexit runs hooks last-in first-out)."""
    from air_magic.calls import background

    background.cancel_all()
    for hook in list(_exit_hooks):  # a persistent session's stop (calls/persistent.py)
        hook()
    warm.at_exit()
    tracking.end_live_runs()


def prestart_local() -> None:
    """Put the warm starter on its way now (``%load_ext``), so the first call finds torch imported
    (and mlflow: calls are tracked unless they say otherwise)."""
    warm.prestart(tracked=True)


def restart_warm_start() -> None:
    """Stop the warm starter; the next call starts a fresh one (after installing packages, say)."""
    warm.restart()
