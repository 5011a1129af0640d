"""Events a backend reports, and the bus that hands them to consumers.

A backend (``backends/``) *produces* events; consumers (``display/``,
``tracking/``, ``calls/history.py``) *consume* them and never drive
processes. A consumer that raises is detached with one warning, so a display
bug can never hang or break a call.

The call's record (its MLflow run) is an event too, :class:`RecordLink`, put on the
bus by the call layer (``calls/call.PreparedCall.run``) once tracking made the run
and before any rank starts: displays show the link, history keeps it, a detached
run's event log replays it to whoever attaches. Backends know nothing of MLflow.
"""

from __future__ import annotations

import enum
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Protocol

from air_magic.protocol.words import Word


class RankState(str, enum.Enum):
    """A rank's life: STARTING -> RUNNING -> one of SUCCEEDED, FAILED, KILLED."""

    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    KILLED = "killed"


class Outcome(Word):
    """How a call ended (or that it has not yet): one word for every place that says it: the
    backends' results, history and ``air-magic runs``, the tracked run's status, the displays and a
    detached or background run's state. A str, so JSON and comparisons with the word still work."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMEOUT = "timeout"
    INTERRUPTED = "interrupted"  # stopped from outside: Ctrl-C, the stop button, cancel(), a signal
    RUNNING = "running"  # not ended yet (a log folder's run.json while its call runs)
    UNKNOWN = "unknown"  # a log folder without a readable run.json
    CANCELLED = "cancelled"  # a detached or background run's word for INTERRUPTED: its handle cancelled it
    # A persistent session's own end (its ranks are gone): what its cells see when it ends under them.
    SESSION_ENDED = "ended"


@dataclass(frozen=True)
class RunStarted:
    call_id: str  # air_magic's id of the call (its log folder's name), not an MLflow run's
    world_size: int
    backend: str
    detected: str
    cpu_mode: bool
    log_dir: str
    name: str
    # How many ranks each node runs, in rank order (node 0 has ranks 0..n0-1, ...); () when not said.
    ranks_per_node: tuple[int, ...] = ()

    def node_of(self) -> list[int]:
        """Each rank's node index (all 0 when the nodes were not said)."""
        nodes = [node for node, count in enumerate(self.ranks_per_node) for _ in range(count)]
        return nodes if len(nodes) == self.world_size else [0] * self.world_size


@dataclass(frozen=True)
class RankStarted:
    rank: int
    pid: int


@dataclass(frozen=True)
class RankOutput:
    """Decoded text a rank wrote; ``stream`` is 'stdout' or 'stderr'. Not split into lines."""

    rank: int
    stream: str
    text: str


@dataclass(frozen=True)
class RankExited:
    rank: int
    state: RankState
    exit_code: int | None
    reason: str


@dataclass(frozen=True)
class Tick:
    """Sent by the call loop a few times a second, so displays can refresh without output."""

    elapsed: float


@dataclass(frozen=True)
class RunFinished:
    """``outcome``: SUCCEEDED, FAILED, TIMEOUT or INTERRUPTED (SESSION_ENDED: a session's own end).

    ``failed_rank`` is the root cause's rank when the outcome is FAILED.
    """

    call_id: str
    outcome: Outcome
    elapsed: float
    log_dir: str
    error: str | None = None
    failed_rank: int | None = None


@dataclass(frozen=True)
class RecordLink:
    """Where the call is recorded (its MLflow run), as displays show it: an event, the first of a
    tracked call's (before its RunStarted)."""

    run_id: str  # the MLflow run's id
    description: str  # what and where the run is, in words
    url: str | None = None  # a page for it, when there is one


@dataclass(frozen=True)
class RankMetrics:
    """New bytes of a rank's metric file (``worker/metrics.py``'s lines), from a node where the
    caller cannot read that file; the tracked run appends them to its own copy. Not in a detached
    run's event log: its supervisor's tracked run stores them."""

    rank: int
    data: bytes


@dataclass(frozen=True)
class CellAnswered:
    """A persistent session's rank answered: ``{"ready": ...}`` once, then ``{"cell": N, "ok": ...,
    "memory": ...}`` for each cell, after every byte that rank printed before it. ``outcome``: the
    cell's pickled value (ok) or error record (not ok). The session (``calls/session_call.py``)
    consumes it; not in an event log (a session is not detached)."""

    rank: int
    answer: dict[str, Any]
    outcome: bytes | None


@dataclass(frozen=True)
class SessionState:
    """What a persistent session holds, for the header of each of its cells (SPEC §15).

    ``ranks``: ``(rank, pid, memory in words)`` per rank; ``cells``: the cells run so far,
    this one included.
    """

    session_id: str
    cells: int
    ranks: tuple[tuple[int, int, str], ...]

    def describe(self) -> str:
        held = ", ".join(f"rank {r} (pid {pid}): {memory}" for r, pid, memory in self.ranks)
        return f"session {self.session_id}, cell {self.cells}; {held}"


Event = (
    RunStarted
    | RankStarted
    | RankOutput
    | RankExited
    | Tick
    | RunFinished
    | SessionState
    | RecordLink
    | RankMetrics
    | CellAnswered
)


class Consumer(Protocol):
    def handle(self, event: Event) -> None: ...


class EventBus:
    """Delivers each event to every consumer; isolates consumer failures."""

    def __init__(self, consumers: list[Consumer] | None = None):
        self._consumers: list[Consumer] = list(consumers or [])

    def add(self, consumer: Consumer) -> None:
        self._consumers.append(consumer)

    def emit(self, event: Event) -> None:
        for consumer in list(self._consumers):
            try:
                consumer.handle(event)
            except Exception:  # noqa: BLE001 - a display must never break a run
                self._consumers.remove(consumer)
                print(
                    f"air_magic: output consumer {type(consumer).__name__} failed and was detached; "
                    "the run continues and every rank's log is still written:\n" + traceback.format_exc(),
                    file=sys.stderr,
                )
