"""What a node's rank group tells the call's caller: the facts of its ranks, as they happen.

A rank group (``node/rank_group.py``) watches the ranks of one call on
one node and reports each fact below; the caller's outcome ledger
(``outcome/ledger.py``) turns them into the call's events and outcome. The local
backend hands them over in-process; a Ray node's agent keeps them until the
caller's next poll (``backends/ray/agent.py``), so they must pickle.

Times are the node's ``time.monotonic()``: the caller adds the node's offset to
the wall clock (zero on the caller's own machine) before it compares two nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from air_magic.protocol.events import CellAnswered, RankMetrics


@dataclass(frozen=True)
class Output:
    """Bytes a rank wrote, in the order it wrote them (``stream``: 'stdout' or 'stderr')."""

    rank: int
    stream: str
    data: bytes


@dataclass(frozen=True)
class Raised:
    """The rank wrote its error record (it may still be exiting): the record's bytes."""

    rank: int
    record: bytes


@dataclass(frozen=True)
class Returned:
    """The rank wrote its result (it may still be exiting: Python waits for its threads)."""

    rank: int


@dataclass(frozen=True)
class Exited:
    """The rank's process ended, after every byte it printed was reported.

    ``code``: its exit status (negative: the signal), None when lost with the
    warm starter; ``when``: first seen gone; ``result``: its pickled value when it
    exited 0 having written one; ``error``: its error record, if any;
    ``teardown_at``: when the group began stopping its ranks (None: it had not);
    ``sigkill_from``: the earliest moment the group could SIGKILL a rank (the teardown plus its
    grace; None: not stopping), so that a rank SIGKILLed before it is known to have died on its own.
    """

    rank: int
    code: int | None
    when: float
    result: bytes | None
    returned: bool
    error: bytes | None
    status_lost: bool
    teardown_at: float | None
    sigkill_from: float | None = None


# Two facts are the call's events as they are: the ledger hands them on to the consumers.
Metrics = RankMetrics  # new lines of a rank's metric file (only where the caller cannot read it)
Answer = CellAnswered  # a persistent session's rank answered a cell (or is ready), after all it printed


@dataclass(frozen=True)
class NodeLost:
    """The node is going (its raylet died): its ranks are lost with it."""

    why: str


@dataclass(frozen=True)
class GroupDone:
    """Every rank of the group was reaped and its output read: nothing more will come."""


NodeEvent = Output | Raised | Returned | Exited | Metrics | Answer | NodeLost | GroupDone
