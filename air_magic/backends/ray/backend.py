"""The Ray backend: every rank on a Ray cluster, behind the same seam as the local backend.

``@distributed(..., cluster="ray")`` (or ``"ray=ADDRESS"``) comes here through
``calls/runners.runner_for``::

    RayBackend.prepare(settings)   connect (cluster.py: ray_init's safe defaults when it starts Ray);
                                   the pool for this many ranks: placement group + one agent per node
                                   (placement.py), their warm starters on their way; the plan
    RayBackend.run(request, bus)   run_loop.RayCall: start, follow and end the call on the agents
    RayBackend.stop()              from any thread: the call ends 'interrupted', every rank stopped
"""

from __future__ import annotations

from air_magic.backends.ray import cluster, placement
from air_magic.backends.ray.run_loop import RayCall
from air_magic.errors import LaunchError
from air_magic.launch.accelerators import AcceleratorPlan
from air_magic.launch.request import LaunchRequest, RunResult, StopRequest
from air_magic.launch.settings import LaunchSettings
from air_magic.node import warm
from air_magic.protocol.events import EventBus


class RayBackend:
    """Runs every rank on a Ray cluster, one agent per node forking that node's ranks."""

    def __init__(self, address: str | None = None, warm_start: bool = True):
        self.address = address
        self.warm_start = warm_start
        self.name = "ray-warm" if warm_start else "ray-fresh"
        self._stop_requested = StopRequest()
        self._pool: placement.Pool | None = None
        self._run: RayCall | None = None  # the call in progress, for stacks()

    def prepare(self, settings: LaunchSettings) -> AcceleratorPlan:
        cluster.require_ray()
        import ray

        if not ray.is_initialized():
            cluster.ray_init(self.address)
        elif self.address and self.address != "auto":
            cluster.check_address(self.address)
        # Reserved for this call from here (a background call's run() comes later, on its thread):
        # another call meanwhile is refused, never given this pool or allowed to release it.
        self._pool = placement.pool_for(settings.num_accelerators, settings.accelerator_type)
        try:
            if self.warm_start and warm.enabled():
                for agent in self._pool.agents:
                    agent.prestart.remote(dict(settings.env))  # torch imported on every node meanwhile
        except BaseException:
            self.release()
            raise
        self._stop_requested.clear()
        return self._pool.plan

    def release(self) -> None:
        """Give back the pool that prepare() reserved (the call ended, or will not run)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.in_use.release()

    def run(self, request: LaunchRequest, bus: EventBus) -> RunResult:
        pool = self._pool
        if pool is None:
            raise LaunchError("RayBackend.run() without prepare() (or after release())")
        try:
            loop = RayCall(
                request,
                bus,
                pool,
                warm_start=self.warm_start and warm.enabled(),
                stop_requested=self._stop_requested,
                starter_wait_s=warm.starter_wait_s(),
            )
            self._run = loop
            return loop.execute()
        finally:
            self._run = None
            self.release()

    def stop(self, grace_s: float | None = None, signum: int | None = None) -> None:
        self._stop_requested.ask(grace_s, signum)

    def stacks(self) -> dict[int, str]:
        run = self._run
        return run.stacks() if run is not None else {}
