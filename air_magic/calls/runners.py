"""Where and how long a call runs: one runner, chosen once from the settings (SPEC §14).

:func:`runner_for` is the one place that decides whether a call is detached
(:func:`outlives_caller` is that rule, for whoever must only know it) and so
where its ranks are started::

    InThisProcess     the backend runs here: run() on the caller's thread (foreground),
                      start() on a daemon thread (calls/background.py); LocalBackend
                      (warm or fresh) or, with cluster="ray", RayBackend
    LocalSupervisor   detach=True: a supervisor process of its own runs it
                      (calls/detached.py, calls/supervisor.py); this process follows
    RayJob            detach=True, cluster="ray": a Ray job's supervisor runs it on the
                      cluster (calls/ray_jobs.py); this process follows

Each runner says what the caller's side prepares with (:meth:`prepare`: the
accelerator plan, and the backend that will start the ranks here, if any), runs
a prepared call to its end (:meth:`run`), starts it and hands back its handle at
once (:meth:`start`). Re-opening a run by its id is not a runner's: the run may be
from another process or version, so ``calls/anywhere.attach`` finds it (a detached run
here or a Ray job) and follows its event log. A backend only
starts and watches processes; it never learns how long the caller stays.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from air_magic.backends.base import Backend
from air_magic.backends.local.backend import LocalBackend
from air_magic.launch.accelerators import AcceleratorPlan
from air_magic.launch.request import RunResult
from air_magic.launch.settings import LaunchSettings
from air_magic.protocol.events import Consumer

OnResult = Callable[[RunResult], Any] | None


class PreparedCall(Protocol):
    """What a runner uses of ``calls/call.PreparedCall`` (named here: call.py imports this module)."""

    name: str
    settings: LaunchSettings

    def displays(self) -> list[Consumer]: ...

    def abandon(self) -> None: ...

    def run(self, displays: Sequence[Consumer], consumers: Sequence[Consumer] = ()) -> RunResult: ...


def outlives_caller(settings: LaunchSettings) -> bool:
    """The one rule: a call is detached (runs under a supervisor of its own) when it says so."""
    return bool(settings.detach)


def ray_address(settings: LaunchSettings) -> tuple[bool, str | None]:
    """(the call runs on a Ray cluster, the address given: None for Ray's own default)."""
    cluster = settings.cluster
    if cluster is None or not cluster.startswith("ray"):
        return False, None
    return True, cluster.partition("=")[2] or None


class Runner(Protocol):
    name: str

    def prepare(self, settings: LaunchSettings) -> tuple[AcceleratorPlan, Backend | None]:
        """What the caller's side needs first: the plan, and the backend that runs the ranks here."""
        ...

    def run(self, prepared: PreparedCall, consumers: Sequence[Consumer] = ()) -> RunResult:
        """Run to the end, the caller following (its displays in the cell or terminal)."""
        ...

    def start(
        self, prepared: PreparedCall, on_result: OnResult = None, consumers: Sequence[Consumer] = ()
    ) -> Any:
        """Start, and hand back the run's handle at once."""
        ...


def runner_for(settings: LaunchSettings, backend: Backend | None = None) -> Runner:
    """The runner of a call with these settings (``backend``: the one to run it here with)."""
    on_ray, address = ray_address(settings)
    if outlives_caller(settings):  # a given backend is not used here: the supervisor has its own
        return RayJob(address) if on_ray else LocalSupervisor()
    if backend is None:
        if on_ray:
            from air_magic.backends.ray.backend import RayBackend  # imports nothing of Ray until it runs

            backend = RayBackend(address, warm_start=settings.warm_start)
        else:
            backend = LocalBackend(warm_start=settings.warm_start)
    return InThisProcess(backend)


class InThisProcess:
    """The backend runs the ranks from this process: in the foreground, or on a daemon thread."""

    name = "here"

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def prepare(self, settings: LaunchSettings) -> tuple[AcceleratorPlan, Backend | None]:
        return self.backend.prepare(settings), self.backend

    def run(self, prepared: PreparedCall, consumers: Sequence[Consumer] = ()) -> RunResult:
        try:
            displays = prepared.displays()
        except BaseException:
            prepared.abandon()
            raise
        return prepared.run(displays, consumers)

    def start(
        self, prepared: PreparedCall, on_result: OnResult = None, consumers: Sequence[Consumer] = ()
    ) -> Any:
        from air_magic.calls import background

        return background.start_background(prepared, on_result=on_result, consumers=consumers)


def follow_to_the_end(handle: Any) -> RunResult:
    """A detached run in the foreground: follow it here to its end. Ctrl-C (the stop button) stops
    following, not the run: it was detached to outlive this process, and ``attach`` treats Ctrl-C
    the same way; the message says how to follow or cancel it."""
    from air_magic.calls import detached

    try:
        handle.exception()  # waits for the end
    except KeyboardInterrupt:
        said = detached.stop_following(handle)
        print(f"air_magic: {said}", file=sys.stderr, flush=True)
        raise KeyboardInterrupt(said) from None
    result: RunResult = handle.run_result()
    return result


class LocalSupervisor:
    """A supervisor process of this machine runs the call (``calls/detached.py``)."""

    name = "detached"

    def prepare(self, settings: LaunchSettings) -> tuple[AcceleratorPlan, Backend | None]:
        # The plan only: the supervisor's ranks start fresh there, so no warm starter here for it.
        backend = LocalBackend(warm_start=False)
        return backend.prepare(settings), backend

    def start(
        self, prepared: PreparedCall, on_result: OnResult = None, consumers: Sequence[Consumer] = ()
    ) -> Any:
        from air_magic.calls import detached

        return detached.start_detached(prepared, on_result, consumers)

    def run(self, prepared: PreparedCall, consumers: Sequence[Consumer] = ()) -> RunResult:
        return follow_to_the_end(self.start(prepared, None, consumers))


class RayJob:
    """A Ray job's supervisor runs the call on the cluster (``calls/ray_jobs.py``); nothing is
    placed from here: the caller checks that the cluster's Jobs API answers."""

    name = "ray-job"

    def __init__(self, address: str | None) -> None:
        self.address = address
        self.client: Any = None

    def prepare(self, settings: LaunchSettings) -> tuple[AcceleratorPlan, Backend | None]:
        from air_magic.backends.ray import jobs_api

        self.client = jobs_api.client_for(self.address)
        count = settings.num_accelerators if isinstance(settings.num_accelerators, int) else 0
        return AcceleratorPlan(world_size=count, gpus=(), detected="a Ray cluster (placed by the job)"), None

    def start(
        self, prepared: PreparedCall, on_result: OnResult = None, consumers: Sequence[Consumer] = ()
    ) -> Any:
        from air_magic.calls import ray_jobs

        assert self.client is not None, "prepare first"
        return ray_jobs.submit(prepared, self.client, self.address, on_result, consumers)

    def run(self, prepared: PreparedCall, consumers: Sequence[Consumer] = ()) -> RunResult:
        return follow_to_the_end(self.start(prepared, None, consumers))
