"""One cell of a persistent session (or its start), as the caller follows it: its answers, its outcome.

``calls/cell_loop.py`` makes a :class:`SessionCell` for each cell it sends
to the ranks, hands it each rank's answer (:meth:`SessionCell.take_answer`) and,
at the end, asks it for its values or its error: the same rules as a call's
(``outcome/ledger.py``, ``outcome/failures.py``), where a rank interrupted because
another failed is a consequence, never the root cause.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from air_magic import paths
from air_magic.errors import LaunchError
from air_magic.outcome.failures import RankFailure, build_exception
from air_magic.outcome.ledger import load_record, load_results
from air_magic.protocol.events import Event, EventBus, RankExited, RankState, RunStarted


@dataclass
class SessionCell:
    """One cell (number 0: the session's start)."""

    number: int
    name: str
    bus: EventBus
    world_size: int
    started: float = field(default_factory=time.monotonic)
    answers: dict[int, bool] = field(default_factory=dict)  # rank -> it ran the cell without error
    first_error_at: float | None = None
    interrupted: list[int] = field(default_factory=list)
    records: dict[int, Any] = field(default_factory=dict)  # rank -> its ErrorRecord (None: unreadable)
    results: dict[int, bytes] = field(default_factory=dict)  # rank -> its pickled value
    logged: bool = False  # its MLflow step is queued (at its end, or as the session ended under it)
    stopped: bool = False  # the session was stopped while it ran (Session.stop() from elsewhere)

    def everyone_answered(self) -> bool:
        return len(self.answers) == self.world_size

    def still_in(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.answers]

    def take_answer(self, rank: int, message: dict[str, Any], outcome: bytes | None) -> None:
        """A rank's answer: ready (the start), or this cell's end on that rank, shown as its exit."""
        if message.get("ready"):
            if self.number == 0:
                self.answers[rank] = True
                self.bus.emit(
                    RankExited(rank=rank, state=RankState.SUCCEEDED, exit_code=None, reason="ready")
                )
            return
        if message.get("cell") != self.number:
            return  # an answer to a cell that already ended (it came after the session gave up)
        ok = bool(message.get("ok"))
        self.answers[rank] = ok
        if ok:
            if outcome is not None:  # (missing: values() says so)
                self.results[rank] = outcome
            reason, state = "returned", RankState.SUCCEEDED
        else:
            self.records[rank] = load_record(outcome)
            if self.first_error_at is None:
                self.first_error_at = time.monotonic()
            if rank in self.interrupted:
                reason, state = "interrupted (SIGINT)", RankState.KILLED
            else:
                reason, state = "raised an exception", RankState.FAILED
        self.bus.emit(RankExited(rank=rank, state=state, exit_code=None, reason=reason))

    def show(self, event: Event) -> None:
        """An event of the session's call, in this cell's view: not the session's start again, nor
        the process end of a rank that raised in this cell (the session's stop that followed): its
        state stays "failed", the cell's root cause or a peer of it."""
        if self.number and isinstance(event, RunStarted):
            return
        if isinstance(event, RankExited) and self.raised_here(event.rank):
            return
        self.bus.emit(event)

    def raised_here(self, rank: int) -> bool:
        """The rank raised in this cell (not our interrupt's KeyboardInterrupt)."""
        return bool(self.number) and rank in self.records and rank not in self.interrupted

    def succeeded(self) -> bool:
        return all(self.answers.get(r) for r in range(self.world_size))

    def values(self) -> list[Any]:
        """Every rank's value, in rank order."""
        missing = [rank for rank in range(self.world_size) if rank not in self.results]
        if missing:
            raise LaunchError(f"rank {missing[0]} answered {self.name} but its result is missing")
        return load_results(None, [(rank, self.results[rank]) for rank in range(self.world_size)])

    def raised_on_its_own(self) -> bool:
        """A rank raised in this cell before any interrupt reached it (not a KeyboardInterrupt of ours)."""
        records = self.records.items()
        return any(record is not None and rank not in self.interrupted for rank, record in records)

    def has_errors(self) -> bool:
        return any(record is not None for record in self.records.values())

    def error(self, log_dir: str, last_lines: Callable[[int], list[str]], cpu_mode: bool) -> BaseException:
        """The root cause's exception (a rank interrupted because another failed is a consequence)."""
        failures = [
            RankFailure.of(rank, record.time, None, record, consequence=rank in self.interrupted)
            for rank, record in sorted(self.records.items())
            if record is not None
        ]
        if not failures:
            return LaunchError(f"{self.name} failed without an error record (logs: {log_dir})")
        return build_exception(
            failures,
            world_size=self.world_size,
            log_path=lambda rank: paths.rank_log(log_dir, rank),
            last_lines=last_lines,
            cpu_mode=cpu_mode,
        )
