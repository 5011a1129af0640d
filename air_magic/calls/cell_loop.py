"""A persistent session's cells, on the caller's thread: send one, follow it, end it (SPEC §15).

``calls/persistent.Session`` is made of a ``calls/session_call.SessionCall`` (the
long call: its ranks' life and its line to them) and the :class:`CellLoop` here,
which uses it. A cell's payload goes to every rank through the backend's
``CellSender``; the call's events and the ranks' answers come back through the
session call's queue and go to the cell's own display and history
(``SessionCell``) until every rank answered, the first error's peers had
:data:`PEER_GRACE_S`, or the cell's timeout ran out. Then the ranks still in the
cell get SIGINT and :data:`RECOVER_S` to report; if one does not, the session
ends. A cell's root cause, and so its tab, history line and MLflow tag, is the
ledger's rule (``outcome/failures.root_cause_rank``) applied to its exception.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from air_magic.calls.held_names import CallerChanges
from air_magic.calls.history import RunHistory
from air_magic.calls.session_call import Answer, FromLoop, SessionCall, SessionStatus
from air_magic.calls.session_cell import SessionCell
from air_magic.display.widgets import make_consumers
from air_magic.errors import ConfigurationError, DistributedTimeoutError, SessionEndedError
from air_magic.launch.payload import build_payload
from air_magic.launch.request import RunResult
from air_magic.outcome.failures import root_cause_rank
from air_magic.outcome.ledger import timeout_error
from air_magic.protocol import serialization
from air_magic.protocol.events import (
    EventBus,
    Outcome,
    RankStarted,
    RunFinished,
    Tick,
)
from air_magic.tracking import session_steps

PEER_GRACE_S = 1.0  # after a rank's error, how long the others get to end the cell on their own
RECOVER_S = 3.0  # after SIGINT, how long a rank gets to report the interrupt before the session ends
_TICK_S = 0.2


@dataclasses.dataclass(frozen=True)
class FailedCell:
    number: int
    why: str
    rank: int | None  # its root cause's rank
    name: str = "cell"
    raised: bool = False  # that rank raised its own exception (not: it died, or the session ended)

    @property
    def words(self) -> str:
        """The cell and its error, in one line (``Session.status``)."""
        return f"{self.name} (cell {self.number}): {self.why.splitlines()[0] if self.why else '?'}"


class CellLoop:
    """Running cells in a session's ranks, one at a time, through its :class:`SessionCall`."""

    def __init__(self, session: SessionCall, caller: CallerChanges, on_end: Callable[[], None]):
        self.session = session
        self._on_end = on_end  # the session is no longer the one cells run in (its end was said)
        self.count = 0  # cells run so far
        self.current: SessionCell | None = None  # the cell running (the loop thread reads it)
        self.failed: list[FailedCell] = []
        self._caller = caller  # what changed in the notebook since the start
        self._busy = threading.Lock()  # one cell at a time
        self._step_lock = threading.Lock()
        session.cells = self

    # -- the start: cell 0 --------------------------------------------------------------------

    def follow_start(self, start: SessionCell) -> None:
        """Wait until every rank is ready; raise the session's end if it does not get there."""
        session = self.session
        try:
            limit = session.settings.timeout
            deadline = None if limit is None else time.monotonic() + limit
            if not self._pump(start, start.everyone_answered, deadline):
                self._end(f"its ranks were not ready within timeout={limit:g} s (it bounds the start too)")
                error = SessionEndedError(
                    f"session {session.id} did not start: {session.ended_why}; every rank is gone"
                )
                self._close(start, Outcome.TIMEOUT, error)
                raise error
        except KeyboardInterrupt:
            self._end("interrupted while it started")
            self._close(start, Outcome.INTERRUPTED, None)
            raise
        if session.finished is not None or not session.running():
            ended = session.error("while it started")
            # Refused before a rank started (a bad --mlflow-run-id): said as a one-off call says it.
            refused = isinstance(ended.__cause__, ConfigurationError)
            raised: BaseException = ended.__cause__ if refused and ended.__cause__ else ended
            self._close(start, Outcome.FAILED, raised)
            raise raised
        session.state = SessionStatus.READY
        start.bus.emit(session.state_event(0))
        self._close(start, Outcome.SUCCEEDED, None)

    # -- one cell ---------------------------------------------------------------------------

    def run_call(
        self,
        name: str,
        func: Callable[..., Any],
        bound: inspect.BoundArguments,
        *,
        kind: str,
        source: str | None = None,
        timeout: float | str | None = "session",
        display: str | None = None,
    ) -> RunResult:
        """Run one cell (or function) on every rank of the session; its values or its error."""
        if not self._busy.acquire(blocking=False):
            raise ConfigurationError(f"a cell of session {self.session.id} is running: one at a time")
        try:
            self.session.raise_if_unusable()
            limit = self.session.settings.timeout if isinstance(timeout, str) else timeout  # 'session'
            return self._run(name, func, bound, kind, source, limit, display)
        finally:
            self._busy.release()

    def _run(
        self,
        name: str,
        func: Callable[..., Any],
        bound: inspect.BoundArguments,
        kind: str,
        source: str | None,
        limit: float | None,
        display: str | None,
    ) -> RunResult:
        session = self.session
        settings = session.settings
        payload = serialization.dumps(
            (build_payload(func, bound, settings.max_payload_bytes), self._caller.now())
        )
        sender, started = session.sender, session.run_started
        assert sender is not None and started is not None
        self.count = number = self.count + 1
        bus = EventBus([RunHistory(summary=False), *make_consumers(display or settings.display)])
        cell = SessionCell(number, name, bus, session.world_size)
        if session.record is not None:
            bus.emit(session.record)
        bus.emit(session.state_event(number))  # then the header is made with it
        bus.emit(dataclasses.replace(started, call_id=f"{session.id}.{number}", name=name))
        for rank, pid in sorted(session.pids.items()):
            bus.emit(RankStarted(rank=rank, pid=pid))
        session_steps.log_cell_source(session.tracked(), number, kind, source)
        session.reset_tails()
        outcome, error = Outcome.FAILED, None
        sent = False
        try:
            self.current = cell
            try:
                sender.send_cell(number, payload)
            except Exception as exc:  # some ranks may have it, others not: no way on
                self._end(f"{name} could not be sent to every rank ({type(exc).__name__}: {exc})")
                raise SessionEndedError(f"session {session.id} ended: {session.ended_why}") from exc
            sent = True
            outcome, error = self._follow(cell, limit)
        except KeyboardInterrupt:
            outcome = Outcome.INTERRUPTED
            if not sent:  # on some nodes the cell may start after the interrupt: the session goes
                self._end(f"{name} was interrupted while it was being sent to the ranks")
                print(f"air_magic: session {session.id} ended: {session.ended_why}", file=sys.stderr)
                raise
            if self._interrupt(cell):
                print(
                    f"air_magic: {name} was interrupted on every rank; session {session.id} goes on",
                    file=sys.stderr,
                )
            raise
        finally:
            self._close(cell, outcome, error)
        if error is not None:
            return RunResult(started.call_id, started.log_dir, outcome, error=error)
        return RunResult(started.call_id, started.log_dir, outcome, values=cell.values())

    def _follow(self, cell: SessionCell, limit: float | None) -> tuple[Outcome, BaseException | None]:
        """Wait for every rank's answer; interrupt the stragglers after an error or the timeout."""
        session = self.session
        deadline = None if limit is None else cell.started + limit

        def done_or_overdue() -> bool:
            overdue = (
                cell.first_error_at is not None and time.monotonic() - cell.first_error_at > PEER_GRACE_S
            )
            return cell.everyone_answered() or overdue

        in_time = self._pump(cell, done_or_overdue, deadline)
        if cell.stopped:  # Session.stop() from elsewhere interrupted its ranks: its end, then ours
            self._pump(cell, lambda: False, None)
            return Outcome.INTERRUPTED, session.stopped_error(cell)
        if session.finished is not None:
            ended = session.error(f"during {cell.name}")
            if cell.has_errors():
                # A rank raised before the session ended (a CUDA error, then a peer's abort): the
                # rank's own exception is the root cause; the end is said beside it.
                print(f"air_magic: {str(ended).splitlines()[0]}", file=sys.stderr)
                return Outcome.FAILED, self._cell_error(cell)
            return Outcome.FAILED, ended
        if not in_time:
            running = cell.still_in()
            stacks = session.stacks(running)
            tails = {r: session.tails[r].last(5) for r in running}  # before the interrupt's traceback
            recovered = self._interrupt(cell)
            return Outcome.TIMEOUT, _timeout_error(session, cell, limit or 0.0, tails, stacks, recovered)
        if not cell.everyone_answered():
            self._interrupt(cell)  # the others are likely waiting for the failed rank in a collective
        if session.finished is None and cell.succeeded():
            return Outcome.SUCCEEDED, None
        return Outcome.FAILED, self._cell_error(cell)

    def _interrupt(self, cell: SessionCell) -> bool:
        """SIGINT to every rank still in the cell; True if each reported it in time (the session
        lives on), else the session ends."""
        session = self.session
        running = cell.still_in()
        if session.finished is not None:
            return False
        if session.sender is not None:
            session.sender.interrupt(running)  # the backend skips a rank whose process has ended
        cell.interrupted = running
        try:
            recovered = self._pump(cell, cell.everyone_answered, time.monotonic() + RECOVER_S)
        except KeyboardInterrupt:  # a second Ctrl-C: no more waiting
            recovered = False
        if recovered and session.finished is None:
            return True
        if session.finished is None:
            late = ", ".join(map(str, cell.still_in()))
            self._end(
                f"rank(s) {late} did not stop {cell.name} within {RECOVER_S:g} s of "
                "SIGINT (a rank blocked in a collective or in C code cannot be interrupted)"
            )
        print(
            f"air_magic: session {session.id} ended: {session.ended_why}. Every rank is gone.",
            file=sys.stderr,
        )
        return False

    def _end(self, why: str) -> None:
        self.session.end(why)
        self._on_end()

    # -- waiting, on the caller's thread -----------------------------------------------------

    def _pump(self, cell: SessionCell, until: Callable[[], bool], deadline: float | None) -> bool:
        """Hand the loop's events and the ranks' answers to ``cell`` until ``until()`` or the session's
        end (True), or ``deadline`` (False)."""
        session = self.session
        next_tick = time.monotonic() + _TICK_S
        while not until() and session.finished is None:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            wait = next_tick - now if deadline is None else min(next_tick, deadline) - now
            item = session.next_item(max(0.0, wait))
            if item is not None:
                self._deliver(cell, item)
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + _TICK_S
                cell.bus.emit(Tick(elapsed=time.monotonic() - cell.started))
        return True

    def _deliver(self, cell: SessionCell, item: FromLoop | Answer) -> None:
        if isinstance(item, Answer):
            cell.take_answer(item.rank, item.message, item.outcome)
            return
        event = item.event
        if isinstance(event, RunFinished):
            self.session.finished = event
            self.session.ended_why = self.session.ended_why or (event.error or event.outcome)
        else:
            cell.show(event)

    def _close(self, cell: SessionCell, outcome: Outcome, error: BaseException | None) -> None:
        """The cell's end, for its display and history; its files go."""
        session = self.session
        ended = session.finished is not None or session.state == SessionStatus.ENDED
        if ended:  # what the ranks printed as they were stopped, and their ends
            session.join(5.0)  # every event of the session's end is in the queue then
            while (item := session.next_item(0)) is not None:
                self._deliver(cell, item)
        self.current = None
        if cell.number:
            cell.bus.emit(session.state_event(cell.number))
        failed_rank = root_cause_rank(error) if outcome is Outcome.FAILED else None
        said = None if error is None else f"{type(error).__name__}: {error}"
        elapsed = time.monotonic() - cell.started
        call_id = f"{session.id}.{cell.number}"
        cell.bus.emit(RunFinished(call_id, outcome, elapsed, session.log_dir or "", said, failed_rank))
        self.log_step_once(cell, outcome)
        if ended:
            session.ended_in_cell = session.ended_in_cell or cell.number or None
            # The session ended under this cell, which said so: the next cell is not told again
            # (as if it had ended "between cells"), it runs fresh ranks as any cell without one.
            self._on_end()
        if cell.number and outcome is not Outcome.SUCCEEDED:
            why = f"{type(error).__name__}: {error}" if error else str(outcome)
            raised = cell.raised_on_its_own()
            self.failed.append(FailedCell(cell.number, why, root_cause_rank(error), cell.name, raised))
        if not ended:  # a rank that dies between cells is quoted from what it printed after this one
            session.reset_tails()

    # -- outcomes ---------------------------------------------------------------------------

    def outcome(
        self, outcome: Outcome, error: str | None, failed_rank: int | None
    ) -> tuple[Outcome, str | None, int | None]:
        """The session's outcome when its ranks did not fail on their own: a cell that failed makes
        it failed, one whose ranks then ended well (its cells counted) or one that ended under it
        (its ranks stopped, not recovered from an error in a collective: that cell's root cause)."""
        current = self.current
        if current is not None and current.stopped:
            return Outcome.INTERRUPTED, f"stopped while {current.name} ran (cell {current.number})", None
        if current is not None and current.number and current.raised_on_its_own():
            cause = self._cell_error(current)
            said = f"{current.name} failed: {type(cause).__name__}: {cause}"
            return Outcome.FAILED, said, root_cause_rank(cause)
        if not self.failed:
            return outcome, error, failed_rank
        first = self.failed[0]
        count = (
            f"{len(self.failed)} of {self.count} cell(s) failed; the first, cell {first.number}: {first.why}"
        )
        return Outcome.FAILED, count, first.rank

    def _cell_error(self, cell: SessionCell) -> BaseException:
        session = self.session
        cpu_mode = session.run_started is not None and session.run_started.cpu_mode
        return cell.error(session.log_dir or "", lambda rank: session.tails[rank].last(10), cpu_mode)

    def log_step_once(self, cell: SessionCell, outcome: Outcome) -> None:
        """One step per cell in the session's run: how long it took and whether it succeeded."""
        with self._step_lock:
            if cell.logged or not cell.number:
                return
            cell.logged = True
        session_steps.log_cell_step(
            self.session.tracked(), cell.number, outcome, time.monotonic() - cell.started
        )


def _timeout_error(
    session: SessionCall,
    cell: SessionCell,
    limit: float,
    tails: dict[int, list[str]],
    stacks: dict[int, str],
    recovered: bool,
) -> DistributedTimeoutError:
    """A cell's timeout: what each rank still in it printed last, their stacks, and what became of
    the session."""
    kept = (
        f"the cell was interrupted on every rank and session {session.id} goes on"
        if recovered
        else f"session {session.id} ended: {session.ended_why}"
    )
    rows = [(rank, tail, False) for rank, tail in tails.items()]
    return timeout_error(limit, rows, stacks, session.log_dir or "", subject=cell.name, then=kept)
