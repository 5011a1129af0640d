"""The caller's ledger of one call's ranks: the facts the nodes report, the events and the outcome.

Every backend's call loop (``backends/call_loop.py``) keeps one. Each node's rank
group reports what happens to its ranks (``protocol/node_events.py``: output, an
error record, a result, an exit, metric lines, a session's answers); the ledger
keeps one :class:`RankRecord` per rank and turns the facts into the call's
events (``RankStarted``, ``RankOutput`` through the output router, ``RankExited``
with the one rule of how a rank ended, :func:`classify_exit`) and, at the end,
into its outcome: the values in rank order, or the error (the root cause by
``outcome/failures.root_cause_order``; the timeout's and the stop's texts here).

Clocks: a node reports its own ``time.monotonic()``; ``clocks[node]`` turns it
into one clock for the whole call (0 on the caller's machine, the node's offset
to the wall clock on a cluster), and ``caller_clock`` does the same for the
caller's own readings (when a node was taken for lost).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from air_magic.errors import DistributedTimeoutError, LaunchError, PayloadError
from air_magic.launch.request import LaunchRequest, rank_succeeded
from air_magic.outcome.failures import (
    RankFailure,
    build_exception,
    exit_words,
    raised_on_its_own,
    root_cause_order,
)
from air_magic.outcome.stacks import timeout_section
from air_magic.protocol import serialization
from air_magic.protocol.events import EventBus, RankExited, RankStarted, RankState
from air_magic.protocol.node_events import (
    Answer,
    Exited,
    GroupDone,
    Metrics,
    NodeEvent,
    NodeLost,
    Output,
    Raised,
    Returned,
)

# A rank that reported its exception has failed, even if its process has not ended yet: its
# interpreter may wait for non-daemon threads or multiprocessing children while exiting. After
# this long the others are not kept waiting for that: the call fails and every rank is stopped.
REPORTED_EXIT_S = 1.0


@dataclass
class RankRecord:
    """What the caller knows of one rank (on either backend)."""

    rank: int
    node: int = 0
    pid: int | None = None
    state: RankState = RankState.STARTING
    exit_code: int | None = None
    exit_time: float | None = None  # on its node's monotonic clock
    result: bytes | None = None  # its pickled value, once it exited 0
    returned: bool = False  # it wrote its result (it may still be exiting)
    error: bytes | None = None  # its error record, as written
    raised_seen: float | None = None  # the caller's clock, when its error record arrived
    lost: str | None = None  # what happened to its node, when the node was lost with it
    lost_at: float | None = None  # the caller's clock then
    status_lost: bool = False  # its exit status died with the warm starter
    ended: bool = False  # its node reported its exit
    never_started: bool = False  # the call was stopped before its node started it

    @property
    def exited(self) -> bool:
        return self.ended or self.lost is not None or self.never_started


def classify_exit(
    request: LaunchRequest, r: RankRecord, teardown_at: float | None, sigkill_from: float | None = None
) -> tuple[RankState, str]:
    """How a rank that exited ended, and the words for it: the one rule of both backends.

    ``teardown_at``: when its node began stopping the ranks (its own clock; None if it had not);
    ``sigkill_from``: the earliest moment its node could SIGKILL it (the teardown plus its grace).
    A rank that ended before the teardown ended on its own; after it, it was stopped by us, unless
    its own exception says otherwise, or it was SIGKILLed before we could have: the OOM killer or a
    ``kill -9`` whose death was seen late (a busy machine: its peers' "connection reset" came first).
    """
    if rank_succeeded(request, r.exit_code, r.returned):
        return RankState.SUCCEEDED, "returned"
    killed_first = (
        r.exit_code == -signal.SIGKILL
        and not r.status_lost
        and sigkill_from is not None
        and r.exit_time is not None
        and r.exit_time < sigkill_from
    )
    if teardown_at is None or (r.exit_time is not None and r.exit_time < teardown_at) or killed_first:
        code = None if r.status_lost else r.exit_code
        if r.error is not None and not (code is not None and code > 1):  # a script's sys.exit(N) says N
            return RankState.FAILED, "raised an exception"
        return RankState.FAILED, _exit_reason(code)
    raised_at = error_time(r.error)
    if raised_at is not None and (raised_at < teardown_at or raised_on_its_own(r.error)):
        # Its own exception, just before the others were stopped (its exit came late), or after it:
        # the same CUDA call failing in every rank, a peer's lost connection.
        return RankState.FAILED, "raised an exception"
    if raised_at is not None:
        return RankState.KILLED, "stopped by air_magic (it raised while stopping)"
    if r.returned:
        return RankState.KILLED, "stopped by air_magic after it returned, while it was exiting"
    return RankState.KILLED, "stopped by air_magic"


def _exit_reason(code: int | None) -> str:
    if code == 1:
        return "raised an exception"
    if code is not None and code > 1:  # a script's sys.exit(N)
        return f"exited with status {code}"
    return exit_words(code)


def error_time(record: bytes | None) -> float | None:
    """When the rank reported its own failure (its node's monotonic clock), if it did."""
    if record is None:
        return None
    try:
        return float(serialization.loads(record).time)
    except Exception:  # noqa: BLE001 - a torn record still says it failed; when is unknown
        return float("-inf")


class CallLedger:
    """One call's ranks as the caller knows them; fed by the nodes' facts, read by the call loop."""

    def __init__(
        self,
        request: LaunchRequest,
        bus: EventBus,
        router: Any,  # backends/output.OutputRouter: the logs, the RankOutput events, the tails
        log_dir: str,
        *,
        ranks_per_node: Sequence[int],
        node_names: Sequence[str] = ("this machine",),
        clocks: Sequence[float] = (0.0,),
        caller_clock: float = 0.0,
    ):
        self.request = request
        self.bus = bus
        self.router = router
        self.log_dir = log_dir
        self.node_names = list(node_names)
        self.clocks = list(clocks)
        self.caller_clock = caller_clock
        self.records: list[RankRecord] = []
        for node, count in enumerate(ranks_per_node):
            self.records.extend(RankRecord(len(self.records), node) for _ in range(count))
        self.done_nodes: set[int] = set()
        self.lost_nodes: set[int] = set()
        self.failed_rank: int | None = None
        self.stopping = False

    # -- facts in ------------------------------------------------------------------------

    def started(self, rank: int, pid: int) -> None:
        record = self.records[rank]
        record.pid, record.state = pid, RankState.RUNNING
        self.bus.emit(RankStarted(rank=rank, pid=pid))

    def take(self, node: int, event: NodeEvent) -> None:
        """One fact from ``node``'s rank group."""
        if isinstance(event, Output):
            self.router.feed(event.rank, event.stream, event.data)
        elif isinstance(event, Raised):
            record = self.records[event.rank]
            record.error = event.record
            if record.raised_seen is None:
                record.raised_seen = time.monotonic()
        elif isinstance(event, Returned):
            self.records[event.rank].returned = True
        elif isinstance(event, Exited):
            self._exited(event)
        elif isinstance(event, (Metrics, Answer)):  # another node's metric lines; a session's answer
            self.bus.emit(event)  # the tracked run and the session consume them (no file here)
        elif isinstance(event, NodeLost):
            self.node_lost(node, event.why)
        elif isinstance(event, GroupDone):
            self.done_nodes.add(node)
            if any(r.node == node and not r.exited and r.pid is not None for r in self.records):
                self.node_lost(node, "its agent stopped watching its ranks (its log says why)")

    def _exited(self, event: Exited) -> None:
        r = self.records[event.rank]
        if r.lost is not None or r.ended:
            return  # killed with its node: already reported as lost
        r.ended = True
        r.exit_code, r.exit_time, r.status_lost = event.code, event.when, event.status_lost
        r.result, r.returned = event.result, r.returned or event.returned or event.result is not None
        if event.error is not None:
            r.error = event.error
        r.state, reason = classify_exit(self.request, r, event.teardown_at, event.sigkill_from)
        self.bus.emit(RankExited(rank=r.rank, state=r.state, exit_code=r.exit_code, reason=reason))

    def begin_teardown(self) -> None:
        """The loop is stopping the ranks: from now on a rank lost with its node was stopped by us."""
        self.stopping = True

    def node_lost(self, node: int, why: str) -> None:
        """``node`` is gone, and its ranks not yet ended with it (failed; killed once stopping)."""
        if node in self.lost_nodes:
            return
        self.lost_nodes.add(node)
        self.done_nodes.add(node)
        said = f"{self.node_names[node]} was lost during the call: {why}"
        for r in self.records:
            if r.node == node and not r.exited:
                r.lost, r.lost_at, r.exit_time = said, time.monotonic(), None
                r.state = RankState.KILLED if self.stopping else RankState.FAILED
                self.bus.emit(
                    RankExited(
                        rank=r.rank, state=r.state, exit_code=None, reason="its node or agent was lost"
                    )
                )

    def never_started(self, node: int) -> None:
        """The call was stopped before ``node`` started these of its ranks (all, or the rest of a
        start cut short): they will never report; its other ranks still do."""
        for r in self.records:
            if r.node == node and r.pid is None and not r.exited:
                r.never_started, r.state = True, RankState.KILLED

    # -- questions -----------------------------------------------------------------------

    def failed(self, now: float) -> bool:
        """A rank failed: it ended badly, its node was lost, or it reported an error REPORTED_EXIT_S ago."""
        for r in self.records:
            if r.lost is not None or r.state is RankState.FAILED:
                return True
            if r.raised_seen is not None and not r.exited and now - r.raised_seen >= REPORTED_EXIT_S:
                return True
        return False

    def all_exited(self) -> bool:
        return all(r.exited for r in self.records)

    def running(self) -> list[int]:
        return [r.rank for r in self.records if not r.exited]

    # -- the outcome ---------------------------------------------------------------------

    def results(self) -> list[Any]:
        """Every rank's value, in rank order (a script's rank that ended with os._exit(0): None)."""
        return load_results(self.request, [(r.rank, r.result) for r in self.records])

    def failure_error(self) -> BaseException:
        """The root cause's exception (outcome/failures.py), once every rank is accounted for."""
        failures: list[RankFailure] = []
        for r in self.records:
            if r.state is not RankState.FAILED:
                continue
            clock = self.clocks[r.node]
            if r.lost is not None:
                lost_at = self.caller_clock + (r.lost_at if r.lost_at is not None else time.monotonic())
                failures.append(RankFailure(r.rank, lost_at, None, None, lost=r.lost))
                continue
            record = load_record(r.error)
            if record is not None:
                failures.append(RankFailure.of(r.rank, clock + record.time, r.exit_code, record))
            else:
                code = None if r.status_lost else r.exit_code
                when = clock + (r.exit_time if r.exit_time is not None else time.monotonic())
                failures.append(RankFailure.of(r.rank, when, code, None))
        if not failures:
            return LaunchError(f"{self.request.name} failed, but no rank reported why; logs: {self.log_dir}")
        self.failed_rank = root_cause_order(failures)[0].rank
        return build_exception(
            failures,
            world_size=len(self.records),
            log_path=self.router.log_path,
            last_lines=lambda rank: self.last_lines(rank, 10),
            cpu_mode=self.request.plan.cpu_mode,
        )

    def timeout_error(self, running: list[int], stacks: dict[int, str]) -> DistributedTimeoutError:
        """The call's timeout ran out with ``running`` still in it (their last lines, their stacks)."""
        rows = [(rank, self.last_lines(rank, 5), self.records[rank].returned) for rank in running]
        return timeout_error(self.request.timeout or 0.0, rows, stacks, self.log_dir)

    def last_lines(self, rank: int, n: int) -> list[str]:
        """What an error quotes of a rank: a session's are its current cell's (its channel keeps
        them), never what an earlier cell printed; a call's are all it printed."""
        channel = self.request.channel
        if channel is not None:
            return channel.last_lines(rank, n)
        return self.router.tails[rank].last(n)


def load_record(data: bytes | None) -> Any:
    """A rank's error record as written (None: none, or torn: the rank's log still has the traceback)."""
    if data is None:
        return None
    try:
        return serialization.loads(data)
    except Exception:  # noqa: BLE001 - a torn record: the rank's log still has the traceback
        return None


def load_results(request: LaunchRequest | None, results: list[tuple[int, bytes | None]]) -> list[Any]:
    """The ranks' pickled values, loaded here in rank order; a value that cannot load is a PayloadError."""
    values: list[Any] = []
    for rank, data in results:
        if data is None:  # a script's rank that ended with os._exit(0): nothing to return
            assert request is not None and request.exit_zero_succeeds, (
                f"rank {rank} succeeded without a result"
            )
            values.append(None)
            continue
        try:
            values.append(serialization.loads(data))
        except Exception as exc:
            raise PayloadError(f"rank {rank}'s return value could not be loaded here: {exc}") from exc
    return values


RETURNED_BUT_EXITING = (
    "had returned but was still exiting (Python waits for non-daemon threads and atexit hooks before a "
    "process ends)"
)


def timeout_error(
    limit: float,
    rows: list[tuple[int, list[str], bool]],
    stacks: dict[int, str],
    log_dir: str,
    *,
    subject: str = "",
    then: str = "every rank was stopped",
) -> DistributedTimeoutError:
    """The one timeout text: ``rows`` are ``(rank, its last lines, it had returned)`` of the ranks
    still running when ``limit`` ran out; ``then`` says what became of them."""
    lines = []
    for rank, tail, returned in rows:
        shown = "\n".join(f"      {line}" for line in tail) if tail else "      (nothing printed)"
        what = RETURNED_BUT_EXITING if returned else "was still running"
        lines.append(f"  rank {rank} {what}; its last lines:\n{shown}")
    lines += timeout_section(stacks, log_dir)
    head = f"{subject} timed out" if subject else "timed out"
    return DistributedTimeoutError(
        f"{head} after {limit:g} s (timeout={limit:g}); {then}.\n"
        + "\n".join(lines)
        + f"\n  Logs: {log_dir}",
        still_running=[rank for rank, _, _ in rows],
        log_dir=log_dir,
    )


def stopped_error(name: str) -> LaunchError:
    """A call stopped from outside (Ctrl-C, the stop button, cancel(), a signal) before it finished."""
    return LaunchError(f"{name} was stopped before it finished; every rank is gone")
