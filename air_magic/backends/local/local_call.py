"""The local backend's call: one rank group on this machine, driven by the caller's own thread.

The template (``backends/call_loop.py``) follows the call; this fills in its
hooks with one :class:`~air_magic.node.rank_group.RankGroup` run
in-process: :meth:`LocalCall.start` makes the rendezvous store and the group
(its call folder, its ranks), :meth:`LocalCall.pump` is one round of the
group's selector, whose facts go straight to the ledger. No thread is added:
the loop that waits for the ranks is the caller's.

Where a rank is started: ``rank_start.RankStart._start_with``, through ``ranks.spawn_rank``.
"""

from __future__ import annotations

import signal
import time

from air_magic.backends.call_loop import CallLoop
from air_magic.errors import DistributedTimeoutError, LaunchError
from air_magic.launch.request import LaunchRequest, StopRequest
from air_magic.node import warm
from air_magic.node.rank_group import GroupSpec, RankGroup
from air_magic.node.rendezvous import HOST_READY_S, LOOPBACK, RendezvousStore
from air_magic.protocol.events import EventBus
from air_magic.protocol.node_events import NodeEvent


class LocalCall(CallLoop):
    """One call's ranks on this machine."""

    def __init__(
        self,
        request: LaunchRequest,
        bus: EventBus,
        *,
        warm_start: bool,
        stop_requested: StopRequest,
    ):
        super().__init__(
            request, bus, stop_requested=stop_requested, ranks_per_node=[request.plan.world_size]
        )
        self.warm_start = warm_start
        self.group: RankGroup | None = None
        self._store: RendezvousStore | None = None

    def _take(self, event: NodeEvent) -> None:
        self.ledger.take(0, event)

    def start(self) -> bool:
        # Bound now (its port goes in the ranks' environment); served once the starter is known.
        self._store = RendezvousStore(self.world, serve=False)
        if self.request.timeout is not None:  # which the ranks' time does not pay for
            self.deadline = time.monotonic() + self.request.timeout
        wait = warm.starter_wait_s()
        if self.deadline is not None:  # no longer than the call's timeout
            wait = max(0.0, min(wait, self.deadline - time.monotonic()))
        spec = GroupSpec.of_call(
            self.request,
            call_id=self.call_id,
            log_dir=self.log_dir,
            ranks=range(self.world),
            node_rank=0,
            master=(LOOPBACK, self._store.port),
            warm_start=self.warm_start,
            starter_wait_s=wait,
            log_root=self.request.log_root,
        )
        self.group = group = RankGroup(spec, self.request.payload, self._take)
        if self.request.channel is not None:  # a persistent session: its line, before its ranks open it
            self.request.channel.connect(_LocalCells(group))
        try:
            started = group.start(
                give_up=lambda: self.stop_requested.is_set() or self._deadline_passed(),
                before_ranks=self._serve_store,
            )
        except OSError as exc:
            raise LaunchError(str(exc)) from exc
        if started is None:
            return False
        for rank, pid in started:
            self.ledger.started(rank, pid)
        return True

    def _serve_store(self, starter: warm.Starter | None) -> None:
        """The store's server: a fork of the warm starter, else this process (importing torch)."""
        assert self._store is not None
        wait = HOST_READY_S
        if self.deadline is not None:  # no longer than the call's timeout
            wait = max(0.0, min(wait, self.deadline - time.monotonic()))
        if starter is None or not self._store.serve_in(starter, wait):
            self._store.serve_here()

    def pump(self, wait_s: float) -> None:
        assert self.group is not None
        self.group.step(wait_s)

    def settle(self) -> None:
        if self.group is not None:
            self.group.settle()

    def stop(self, grace_s: float, signum: int = signal.SIGTERM) -> None:
        self.ledger.begin_teardown()
        if self.group is not None:
            self.group.stop(grace_s, signum)

    def stacks(self, why: str = "on request") -> dict[int, str]:
        group = self.group
        return group.stacks(why) if group is not None else {}

    def fail(self) -> BaseException:
        if warm.process_exiting():
            self.stop(0)
            return LaunchError(
                "the call was stopped: the Python process that made it is exiting "
                "(a call in a daemon thread does not keep a process alive)"
            )
        return super().fail()

    def start_timeout_error(self) -> BaseException:
        """The timeout ran out while the warm starter was still importing: no rank ever ran."""
        starter = warm.starting()
        who = f"the warm starter (pid {starter.proc.pid})" if starter is not None else "the warm starter"
        log = f" Its log: {starter.log_path}." if starter is not None and starter.log_path else ""
        timeout = self.request.timeout or 0.0
        return DistributedTimeoutError(
            f"timed out after {timeout:g} s (timeout={timeout:g}) before any "
            f"rank started: {who} was still importing {', '.join(warm.preload_list()) or 'its modules'}."
            f"{log} No rank ran. A longer timeout lets it finish (later calls then start in "
            "milliseconds); warm_start=False starts fresh ranks instead.",
            still_running=[],
            log_dir=self.log_dir,
        )

    def finish(self) -> None:
        try:
            if self.group is not None:
                try:
                    self.group.finish()
                finally:
                    self.group.close()  # the call folder, the lifeline, the held starter: always
        finally:
            if self._store is not None:
                self._store.close()


class _LocalCells:
    """The local backend's CellSender: the session's pipes, and SIGINT through the group."""

    def __init__(self, group: RankGroup):
        self._group = group

    def send_cell(self, number: int, payload: bytes) -> None:
        assert self._group.session_pipes is not None
        self._group.session_pipes.send_cell(number, payload)

    def send_stop(self) -> None:
        assert self._group.session_pipes is not None
        self._group.session_pipes.send_stop()

    def interrupt(self, ranks: list[int]) -> None:
        self._group.interrupt(ranks)
