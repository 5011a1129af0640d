"""A persistent session's cells, on the caller's thread: send one, follow it, end it (SPEC §15).

The cell loop part of :class:`~air_magic.calls.persistent.Session`, which mixes
it in (the session's life, its names and its line to the backend stay there).
A cell's payload goes to every rank through the backend's ``CellSender``; the
loop's events and the ranks' answers come back through the session's queue
and go to the cell's own display and history (``SessionCell``) until every rank
answered, the first error's peers had :data:`PEER_GRACE_S`, or the cell's
timeout ran out. Then the ranks still in the cell get SIGINT and
:data:`RECOVER_S` to report; if one does not, the session ends.
"""

from __future__ import annotations

import dataclasses
import inspect
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from air_magic.backends.output import RankTail
from air_magic.calls.held_names import CallerChanges
from air_magic.calls.history import RunHistory
from air_magic.calls.session_cell import SessionCell
from air_magic.display.widgets import make_consumers
from air_magic.errors import ConfigurationError, DistributedTimeoutError, SessionEndedError
from air_magic.launch.failures import root_cause_rank
from air_magic.launch.ledger import timeout_error
from air_magic.launch.payload import build_payload
from air_magic.launch.request import CellSender, RunResult
from air_magic.launch.settings import LaunchSettings
from air_magic.protocol import serialization
from air_magic.protocol.events import (
    EventBus,
    Outcome,
    RankStarted,
    RecordLink,
    RunFinished,
    RunStarted,
    SessionState,
    Tick,
)
from air_magic.tracking import session_steps
from air_magic.worker import cell_runner

if TYPE_CHECKING:
    from air_magic.calls.call import PreparedCall

PEER_GRACE_S = 1.0  # after a rank's error, how long the others get to end the cell on their own
RECOVER_S = 3.0  # after SIGINT, how long a rank gets to report the interrupt before the session ends
_TICK_S = 0.2


class CellLoop:
    """Running cells in a session's ranks (mixed into Session, which holds the state below)."""

    id: str
    settings: LaunchSettings
    world_size: int
    cells: int
    state: str
    ended_why: str | None
    log_dir: str | None
    record: RecordLink | None
    _prepared: PreparedCall | None
    _thread: threading.Thread | None
    _queue: queue.SimpleQueue[tuple[Any, ...]]
    _lock: threading.Lock
    _busy: threading.Lock
    _current: SessionCell | None
    _finished: RunFinished | None
    _run_started: RunStarted | None
    _pids: dict[int, int]
    _tails: list[RankTail]
    _failed_cells: list[tuple[int, str, int | None]]
    _sender: CellSender | None
    _caller: CallerChanges

    # The session's side (persistent.Session).
    def _check_usable(self) -> None:
        raise NotImplementedError

    def _end(self, why: str) -> None:
        raise NotImplementedError

    def _session_error(self, when: str) -> SessionEndedError:
        raise NotImplementedError

    def _state_event(self, cells: int) -> SessionState:
        raise NotImplementedError

    def _tracked(self) -> Any:
        raise NotImplementedError

    def _deactivate(self) -> None:
        raise NotImplementedError

    # -- one cell ---------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank of the session; every rank's value, in rank order."""
        bound = inspect.signature(fn).bind(*args, **kwargs)
        name = getattr(fn, "__name__", "function")
        return self.run_call(name, fn, bound, kind="function").unwrap()

    def run_cell(self, source: str, timeout: float | str | None = "session") -> list[Any]:
        """Run ``source`` in every rank's globals; every rank's value of its last expression.

        ``timeout``: seconds for this cell (None: none); default the session's."""
        filename = f"<session {self.id} cell {self.cells + 1}>"  # its own lines in tracebacks
        bound = inspect.signature(cell_runner.run_cell).bind(source, filename, {}, {}, [])
        outcomes = self.run_call(
            "cell", cell_runner.run_cell, bound, kind="cell", source=source, timeout=timeout
        ).unwrap()
        return [None if o.value is None else serialization.loads(o.value) for o in outcomes]

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
            raise ConfigurationError(f"a cell of session {self.id} is running: one at a time")
        try:
            return self._run_locked(name, func, bound, kind, source, timeout, display)
        finally:
            self._busy.release()

    def _run_locked(
        self,
        name: str,
        func: Callable[..., Any],
        bound: inspect.BoundArguments,
        kind: str,
        source: str | None,
        timeout: float | str | None,
        display: str | None,
    ) -> RunResult:
        self._check_usable()
        payload = serialization.dumps(
            (build_payload(func, bound, self.settings.max_payload_bytes), self._caller.now())
        )
        assert self._sender is not None and self._run_started is not None
        number = self.cells + 1
        self.cells = number
        limit = self.settings.timeout if isinstance(timeout, str) else timeout  # 'session': the session's
        displays = make_consumers(display or self.settings.display, self.record)
        bus = EventBus([RunHistory(self.record, summary=False), *displays])
        cell = SessionCell(number, name, bus, self.world_size, displays)
        started = self._run_started
        cell.bus.emit(self._state_event(number))  # first: the header is made with it
        cell.bus.emit(dataclasses.replace(started, run_id=f"{self.id}.{number}", name=name))
        for rank, pid in sorted(self._pids.items()):
            cell.bus.emit(RankStarted(rank=rank, pid=pid))
        session_steps.log_cell_source(self._tracked(), number, kind, source)
        # The cell's own last lines: an error of this cell never quotes what an earlier one printed.
        self._tails = [RankTail() for _ in range(self.world_size)]
        outcome, error = Outcome.FAILED, None
        sent = False
        try:
            with self._lock:
                self._current = cell
            try:
                self._sender.send_cell(number, payload)
            except Exception as exc:  # some ranks may have it, others not: no way on
                self._end(f"{name} could not be sent to every rank ({type(exc).__name__}: {exc})")
                raise SessionEndedError(f"session {self.id} ended: {self.ended_why}") from exc
            sent = True
            outcome, error = self._follow(cell, limit)
        except KeyboardInterrupt:
            outcome = Outcome.INTERRUPTED
            if not sent:  # on some nodes the cell may start after the interrupt: the session goes
                self._end(f"{name} was interrupted while it was being sent to the ranks")
                print(f"air_magic: session {self.id} ended: {self.ended_why}", file=sys.stderr)
                raise
            recovered = self._interrupt(cell)
            if recovered:
                print(
                    f"air_magic: {name} was interrupted on every rank; session {self.id} goes on",
                    file=sys.stderr,
                )
            raise
        finally:
            self._close_cell(cell, outcome, error)
        if error is not None:
            return RunResult(started.run_id, started.log_dir, outcome, error=error)
        return RunResult(started.run_id, started.log_dir, outcome, values=cell.values())

    def _follow(self, cell: SessionCell, limit: float | None) -> tuple[Outcome, BaseException | None]:
        """Wait for every rank's answer; interrupt the stragglers after an error or the timeout."""
        deadline = None if limit is None else cell.started + limit

        def done_or_overdue() -> bool:
            overdue = (
                cell.first_error_at is not None and time.monotonic() - cell.first_error_at > PEER_GRACE_S
            )
            return cell.everyone_answered() or overdue

        in_time = self._pump(cell, done_or_overdue, deadline)
        if self._finished is not None:
            ended = self._session_error(f"during {cell.name}")
            if cell.has_errors():
                # A rank raised before the session ended (a CUDA error, then a peer's abort): the
                # rank's own exception is the root cause; the end is said beside it.
                print(f"air_magic: {str(ended).splitlines()[0]}", file=sys.stderr)
                return Outcome.FAILED, self._cell_error(cell)
            return Outcome.FAILED, ended
        if not in_time:
            running = cell.still_in()
            stacks = self._stacks(running)
            tails = {r: self._tails[r].last(5) for r in running}  # before the interrupt's traceback
            recovered = self._interrupt(cell)
            return Outcome.TIMEOUT, self._timeout_error(cell, limit or 0.0, tails, stacks, recovered)
        if not cell.everyone_answered():
            self._interrupt(cell)  # the others are likely waiting for the failed rank in a collective
        if self._finished is None and cell.succeeded():
            return Outcome.SUCCEEDED, None
        return Outcome.FAILED, self._cell_error(cell)

    def _interrupt(self, cell: SessionCell) -> bool:
        """SIGINT to every rank still in the cell; True if each reported it in time (the session
        lives on), else the session ends."""
        running = cell.still_in()
        if self._finished is not None:
            return False
        if self._sender is not None:
            self._sender.interrupt(running)  # the backend skips a rank whose process has ended
        cell.interrupted = running
        try:
            recovered = self._pump(cell, cell.everyone_answered, time.monotonic() + RECOVER_S)
        except KeyboardInterrupt:  # a second Ctrl-C: no more waiting
            recovered = False
        if recovered and self._finished is None:
            return True
        if self._finished is None:
            late = cell.still_in()
            self._end(
                f"rank(s) {', '.join(map(str, late))} did not stop {cell.name} within {RECOVER_S:g} s of "
                "SIGINT (a rank blocked in a collective or in C code cannot be interrupted)"
            )
        print(f"air_magic: session {self.id} ended: {self.ended_why}. Every rank is gone.", file=sys.stderr)
        return False

    # -- waiting, on the caller's thread -----------------------------------------------------

    def _pump(self, cell: SessionCell, until: Callable[[], bool], deadline: float | None) -> bool:
        """Hand the loop's events and the ranks' answers to ``cell`` until ``until()`` or the session's
        end (True), or ``deadline`` (False)."""
        next_tick = time.monotonic() + _TICK_S
        while not until() and self._finished is None:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            wait = next_tick - now if deadline is None else min(next_tick, deadline) - now
            try:
                item = self._queue.get(timeout=max(0.0, wait))
            except queue.Empty:
                item = None
            if item is not None:
                self._deliver(cell, item)
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + _TICK_S
                cell.bus.emit(Tick(elapsed=time.monotonic() - cell.started))
        return True

    def _deliver(self, cell: SessionCell, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if kind == "event":
            event = item[1]
            if isinstance(event, RunFinished):
                self._finished = event
                self.ended_why = self.ended_why or (event.error or event.outcome)
                return
            if isinstance(event, RunStarted) and cell.number != 0:
                return
            cell.bus.emit(event)
        elif kind == "answer":
            cell.take_answer(*item[1:])

    def _close_cell(self, cell: SessionCell, outcome: Outcome, error: BaseException | None) -> None:
        """The cell's end, for its display and history; its files go."""
        if self._finished is not None or self.state == "ended":
            self._drain_queue(cell)  # what the ranks printed as they were stopped, and their ends
        with self._lock:
            self._current = None
        if cell.number:
            cell.bus.emit(self._state_event(cell.number))
        cell.bus.emit(
            RunFinished(
                run_id=f"{self.id}.{cell.number}",
                outcome=outcome,
                elapsed=time.monotonic() - cell.started,
                log_dir=self.log_dir or "",
                error=None if error is None else f"{type(error).__name__}: {error}",
                failed_rank=root_cause_rank(error) if outcome is Outcome.FAILED else None,
            )
        )
        self._log_step_once(cell, outcome)
        if self._finished is not None or self.state == "ended":
            # The session ended under this cell, which said so: the next cell is not told again
            # (as if it had ended "between cells"), it runs fresh ranks as any cell without one.
            self._deactivate()
        if cell.number and outcome is not Outcome.SUCCEEDED:
            why = f"{type(error).__name__}: {error}" if error else outcome
            self._failed_cells.append((cell.number, why, root_cause_rank(error)))

    def _drain_queue(self, cell: SessionCell) -> None:
        if self._thread is not None:
            self._thread.join(5.0)  # every event of the session's end is in the queue then
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            self._deliver(cell, item)

    # -- outcomes ---------------------------------------------------------------------------

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """The thread stacks of these ranks, from the backend (on this machine or the nodes')."""
        prepared = self._prepared
        if prepared is None:
            return {}
        try:
            return {r: text for r, text in prepared.backend.stacks().items() if r in ranks}
        except Exception:  # noqa: BLE001 - stacks are a help; the timeout's error goes out anyway
            return {}

    def _cell_error(self, cell: SessionCell) -> BaseException:
        run = self._run_started
        cpu_mode = run is not None and run.cpu_mode
        return cell.error(self.log_dir or "", lambda rank: self._tails[rank].last(10), cpu_mode)

    def _timeout_error(
        self,
        cell: SessionCell,
        limit: float,
        tails: dict[int, list[str]],
        stacks: dict[int, str],
        recovered: bool,
    ) -> DistributedTimeoutError:
        kept = (
            f"the cell was interrupted on every rank and session {self.id} goes on"
            if recovered
            else f"session {self.id} ended: {self.ended_why}"
        )
        rows = [(rank, tail, False) for rank, tail in tails.items()]
        return timeout_error(limit, rows, stacks, self.log_dir or "", subject=cell.name, then=kept)

    def _log_step_once(self, cell: SessionCell, outcome: Outcome) -> None:
        """One step per cell in the session's run: how long it took and whether it succeeded."""
        with self._lock:
            if cell.logged or not cell.number:
                return
            cell.logged = True
        session_steps.log_cell_step(self._tracked(), cell.number, outcome, time.monotonic() - cell.started)
