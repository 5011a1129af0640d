"""A persistent session (SPEC §15): ranks that stay up between cells and keep their globals.

The session is one long call. Its function is ``worker/session_rank.serve``; it
is prepared and run like any call (``session/call.py``: the accelerator plan,
the GPU claim, one MLflow run, the backend's loop with its lifeline, pidfds and
teardown, locally or on Ray), on a thread of its own. :class:`Session` is the
request's ``CellChannel`` (``launch/request.py``): before any rank starts the
backend hands it a ``CellSender`` (a cell to every rank, stop, SIGINT to some
ranks; on each node ``backends/local/session_pipes.py``), and passes it each
rank's answer to a cell after everything that rank printed before it. The
loop's events and the answers go through one queue to the thread that runs the
cell (the caller's), which feeds the cell's own display and history: the tabs
and the text appear in the cell that ran, in order.

Failures: a rank that raises reports like a call's rank (its exception and
traceback) and lives on. After the first error the others get
:data:`PEER_GRACE_S` to finish the cell; then, as on Ctrl-C or a cell's
timeout, the ranks still in the cell get SIGINT and :data:`RECOVER_S` to
report. If every rank does, the session lives on; if not, or if a rank dies,
the session ends (every rank stopped, as at the end of a call) and says why.
The kernel's exit stops it (``call.on_exit``); its death takes the ranks with
the lifeline. Decisions: docs/session.md.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from air_magic import paths
from air_magic.backends.output import RankTail
from air_magic.display.widgets import make_consumers
from air_magic.errors import ConfigurationError, DistributedTimeoutError, LaunchError
from air_magic.launch.failures import RankFailure, build_exception
from air_magic.launch.ledger import load_results, timeout_error
from air_magic.launch.payload import build_payload
from air_magic.launch.request import CellSender, RunResult, new_run_id
from air_magic.launch.settings import LaunchSettings, make_settings
from air_magic.protocol import env_names, serialization
from air_magic.protocol.events import (
    Event,
    EventBus,
    RankExited,
    RankOutput,
    RankStarted,
    RankState,
    RecordLink,
    RunFinished,
    RunStarted,
    SessionState,
    Tick,
)
from air_magic.session import call, history
from air_magic.session.history import RunHistory
from air_magic.worker import cell_runner, session_rank

PEER_GRACE_S = 1.0  # after a rank's error, how long the others get to end the cell on their own
RECOVER_S = 3.0  # after SIGINT, how long a rank gets to report the interrupt before the session ends
STOP_WAIT_S = 10.0  # `session stop`: how long the ranks get to end on their own before they are stopped
SLOW_STOP_S = 2.0  # after this long, a stop that waits on its ranks says why
END_GRACE_S = 1.0  # when the session's ranks are stopped at last: SIGINT, then SIGKILL after this
_TICK_S = 0.2

_ABSENT = object()  # a name the notebook did not have when a cell bound it in the ranks
_active: Session | None = None
_last: Session | None = None  # the newest session started, running or not (%distributed session status)
_active_lock = threading.Lock()


class SessionEndedError(LaunchError):
    """The session's ranks are gone (a rank died, or did not recover from an interrupt)."""


@dataclass
class _Cell:
    """One cell (or the session's start) as the caller's thread follows it."""

    number: int
    name: str
    bus: EventBus
    started: float = field(default_factory=time.monotonic)
    answers: dict[int, bool] = field(default_factory=dict)  # rank -> it ran the cell without error
    first_error_at: float | None = None
    interrupted: list[int] = field(default_factory=list)
    records: dict[int, Any] = field(default_factory=dict)  # rank -> its ErrorRecord (None: unreadable)
    results: dict[int, bytes] = field(default_factory=dict)  # rank -> its pickled value
    logged: bool = False  # its MLflow step is queued (at its end, or as the session ended under it)


FINGERPRINT_LIMIT = 64 * 2**20  # bytes of pickle: a larger object held by the ranks is kept by identity


def _digest(value: Any) -> bytes | None:
    """The value's data fingerprint (as one-off cells compare them), None when it cannot be taken:
    unpicklable, or larger than FINGERPRINT_LIMIT (a model: pickling it at every cell that reads it
    would cost more than the cell; its in-place changes in the notebook need ``--push NAME``)."""
    try:
        return serialization.fingerprint(value, limit=FINGERPRINT_LIMIT)
    except Exception:  # noqa: BLE001 - kept by identity alone, as before
        return None


def active() -> Session | None:
    """The session ``%%distributed`` cells run in now (None: cells start fresh ranks)."""
    with _active_lock:
        session = _active
    return session if session is not None and session.alive() else None


def for_cell() -> Session | None:
    """The session the next ``%%distributed`` cell runs in (None: no session, fresh ranks).

    A session that ended since its last cell (a rank died) raises its end here, once: the cell
    must not quietly start fresh ranks with the notebook's copies of the ranks' state."""
    global _active
    with _active_lock:
        session = _active
    if session is None or session.alive():
        return session
    with _active_lock:
        if _active is session:
            _active = None
    raise session._session_error("between cells")


def last() -> Session | None:
    """The newest session of this process, even if it has ended."""
    return _last


def stop_all() -> None:
    """The interpreter is exiting: the active session's ranks end now (the lifeline would too)."""
    session = _active
    if session is not None and session.alive():
        session.stop(wait_s=2.0, quiet=True)


call.on_exit(stop_all)


class Session:
    """A persistent session: start it, run cells and functions in it, stop it.

    ``with air_magic.session(num_accelerators=2) as s:`` starts it and makes it the
    active session (``%%distributed`` cells run in it); ``s.run(fn, *args)`` runs a
    function on every rank and returns every rank's value; the block's end stops it.
    """

    def __init__(self, settings: LaunchSettings, name: str = "session"):
        if settings.detach:
            raise ConfigurationError("a persistent session lives in this process: detach=True is not for it")
        self.settings = settings
        self.name = name
        self.id = new_run_id()
        self.state = "new"  # 'starting', 'ready', 'ended'
        self.world_size = 0
        self.cells = 0
        self.ended_why: str | None = None
        self.log_dir: str | None = None
        self.record: RecordLink | None = None
        self._prepared: call.PreparedCall | None = None
        self._thread: threading.Thread | None = None
        self._queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._busy = threading.Lock()  # one cell at a time
        self._current: _Cell | None = None
        self._finished: RunFinished | None = None  # the session's own end, once the caller saw it
        self._result: RunResult | None = None
        self._error: BaseException | None = None
        self._run_started: RunStarted | None = None
        self._pids: dict[int, int] = {}
        self._memory: dict[int, dict[str, int]] = {}
        self._tails: list[RankTail] = []  # each rank's last lines of the cell running (new per cell)
        self._ended_ranks: dict[int, str] = {}  # rank -> how it ended (status shows no memory for it)
        self._failed_cells: list[tuple[int, str]] = []  # (cell, why), for the session's own outcome
        self._sender: CellSender | None = None  # the backend's line to the ranks (connect())
        # name -> the notebook's object for it when a cell last bound it in the ranks (the copy that came
        # back, the stale one a failed pull-back left, or _ABSENT): not sent again while it is the same
        self._held: dict[str, Any] = {}
        self._held_digest: dict[str, bytes | None] = {}  # their data fingerprints then (None: not taken)
        # The notebook's environment when the ranks started: each cell brings the changes since.
        self._env_at_start = dict(os.environ)
        self._kept_said: set[str] = set()  # names whose change the ranks do not follow, said once
        self._env_sent: set[str] = set()  # names a cell set in the ranks (unset there once gone here)

    # -- the surface's side ---------------------------------------------------------------

    def __enter__(self) -> Session:
        if self.state == "new":
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<air_magic session {self.id}: {self.state}, {self.world_size} rank(s), {self.cells} cell(s)>"

    def alive(self) -> bool:
        return self.state == "ready" and not (self._thread is not None and not self._thread.is_alive())

    def start(self) -> Session:
        """Start the ranks, set up their process group, and make this the active session."""
        global _active, _last
        if self.state != "new":
            raise ConfigurationError(f"session {self.id} was already started ({self.state})")
        current = active()
        if current is not None:
            raise ConfigurationError(
                f"session {current.id} is running ({current.world_size} rank(s)): stop it first "
                "(%distributed session stop, or session.stop())"
            )
        func = session_rank.serve
        # The cells have the timeouts. The call's own stop comes only once the session has given its
        # ranks their chance (a stop's wait, an interrupt's recovery): then a short grace.
        settings = dataclasses.replace(self.settings, timeout=None, stop_grace=END_GRACE_S)
        # Named with its id: the run's name, and what a call refused its GPUs is told holds them.
        prepared = call.prepare_call(
            f"{self.name} {self.id}", func, inspect.signature(func).bind(), settings, kind="session"
        )
        prepared.channel = self
        prepared.run_id = self.id
        self._prepared = prepared
        self.world_size = prepared.plan.world_size
        self._tails = [RankTail() for _ in range(self.world_size)]
        self.state = "starting"
        _last = self
        start = _Cell(0, f"{self.name} {self.id} (start)", EventBus(prepared.displays()))
        with self._lock:
            self._current = start
        self._thread = threading.Thread(target=self._serve, name=f"air_magic-session-{self.id}", daemon=True)
        try:
            self._thread.start()
        except BaseException:
            prepared.abandon()
            self.state = "ended"
            raise
        try:
            limit = self.settings.timeout
            deadline = None if limit is None else time.monotonic() + limit
            if not self._pump(start, lambda: len(start.answers) == self.world_size, deadline):
                self._end(f"its ranks were not ready within {limit:g} s (timeout=)")
                error = SessionEndedError(
                    f"session {self.id} did not start: {self.ended_why}; every rank is gone"
                )
                self._close_cell(start, "timeout", error)
                raise error
        except KeyboardInterrupt:
            self._end("interrupted while it started")
            self._close_cell(start, "interrupted", None)
            raise
        if self._finished is not None:
            error = self._session_error("while it started")
            self._close_cell(start, "failed", error)
            raise error
        if not self._thread.is_alive():
            error = self._session_error("while it started")
            self._close_cell(start, "failed", error)
            raise error
        self.state = "ready"
        start.bus.emit(self._state_event(0))
        self._close_cell(start, "succeeded", None)
        with _active_lock:
            _active = self
        return self

    def stop(self, wait_s: float = STOP_WAIT_S, quiet: bool = False) -> None:
        """End the session: each rank leaves its loop (its process group ends), then every process
        is gone. Safe to call twice."""
        global _active
        self._held.clear()  # the notebook's objects are its own again (and not kept alive here)
        with _active_lock:
            if _active is self:
                _active = None
        if self.state == "ended" or self._thread is None:
            self.state = "ended"
            return
        self.ended_why = self.ended_why or "stopped"
        if self._sender is not None:
            self._sender.send_stop()
        self._thread.join(min(wait_s, SLOW_STOP_S))
        if self._thread.is_alive() and wait_s > SLOW_STOP_S:
            self._say_why_slow(wait_s)
            self._thread.join(wait_s - SLOW_STOP_S)
        stopped = self._thread.is_alive()
        if stopped:
            self._stop_ranks()
        self.state = "ended"
        if not quiet:
            how = f"stopped after {wait_s:g} s" if stopped else "every rank is gone"
            print(f"air_magic: session {self.id} stopped; {how}")

    def _say_why_slow(self, wait_s: float) -> None:
        """Ranks that have not ended SLOW_STOP_S after the stop: usually a thread that is not a daemon
        (Python waits for it before a process ends). Said, with their stacks, not waited in silence."""
        left = sorted(r for r in self._pids if r not in self._ended_ranks)
        where = ""
        prepared = self._prepared
        if prepared is not None and self.log_dir:
            try:
                prepared.backend.stacks()  # every thread of every rank, into stacks.txt
                where = f"; their threads' stacks: {os.path.join(self.log_dir, paths.STACKS_FILE)}"
            except Exception:  # noqa: BLE001 - a help only
                where = ""
        print(
            f"air_magic: session {self.id}: rank(s) {', '.join(map(str, left)) or '?'} still ending "
            f"{SLOW_STOP_S:g} s after the stop (a thread that is not a daemon keeps Python from "
            f"exiting); they are stopped at {wait_s:g} s{where}",
            file=sys.stderr,
            flush=True,
        )

    def restart(self) -> Session:
        """Stop this session and start a new one with the same settings (the new one is returned)."""
        self.stop(quiet=True)
        return Session(self.settings, self.name).start()

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

    def status(self) -> str:
        """The session in words: its ranks, what each holds, the cells run, where its logs are."""
        lines = [f"session {self.id}: {self.state}, {self.world_size} rank(s), {self.cells} cell(s) run"]
        if self.ended_why and self.state == "ended":
            lines.append(f"  ended: {self.ended_why}")
        for rank in range(self.world_size):
            pid = self._pids.get(rank)
            if rank in self._ended_ranks:
                lines.append(f"  rank {rank}: pid {pid}, ended ({self._ended_ranks[rank]})")
            else:
                lines.append(f"  rank {rank}: pid {pid}, {memory_words(self._memory.get(rank))}")
        if self.log_dir:
            lines.append(f"  logs: {self.log_dir}")
        if self.record is not None:
            lines.append(f"  {self.record.url or self.record.description}")
        return "\n".join(lines)

    # -- names between the notebook and the ranks ------------------------------------------

    def held_by_ranks(self, name: str, value: Any) -> bool:
        """The ranks have their own ``name``, and the notebook has neither rebound it since a cell bound
        it there (its value is the copy that came back, or what it held then) nor changed it in place
        (``b.v = 100`` in the notebook: its data fingerprint differs, so the cell sends it again)."""
        if name not in self._held or self._held[name] is not value:
            return False
        digest = self._held_digest.get(name)
        return digest is None or _digest(value) == digest

    def note_held(self, names: dict[str, Any]) -> None:
        """``name -> the notebook's value now`` for names a cell bound in the ranks (_ABSENT: none)."""
        self._held.update(names)
        for name, value in names.items():
            self._held_digest[name] = None if value is _ABSENT else _digest(value)

    def forget(self, names: list[str]) -> None:
        for name in names:
            self._held.pop(name, None)
            self._held_digest.pop(name, None)

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
            (build_payload(func, bound, self.settings.max_payload_bytes), self._caller())
        )
        assert self._sender is not None and self._run_started is not None
        number = self.cells + 1
        self.cells = number
        limit = self.settings.timeout if isinstance(timeout, str) else timeout  # 'session': the session's
        displays = make_consumers(display or self.settings.display, self.record)
        cell = _Cell(number, name, EventBus([RunHistory(self.record, summary=False), *displays]))
        started = self._run_started
        cell.bus.emit(self._state_event(number))  # first: the header is made with it
        cell.bus.emit(dataclasses.replace(started, run_id=f"{self.id}.{number}", name=name))
        for rank, pid in sorted(self._pids.items()):
            cell.bus.emit(RankStarted(rank=rank, pid=pid))
        self._track_cell_source(number, kind, source)
        # The cell's own last lines: an error of this cell never quotes what an earlier one printed.
        self._tails = [RankTail() for _ in range(self.world_size)]
        outcome, error = "failed", None
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
            outcome = "interrupted"
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
        return RunResult(started.run_id, started.log_dir, outcome, values=self._results(cell))

    def _caller(self) -> dict[str, Any]:
        """Where the notebook stands now, for the ranks to follow before the cell (as a one-off call's
        fresh ranks would start): its folder, ``sys.path``, and its environment's changes since the
        session started, except the names the launcher gives each rank (said once, here)."""
        now = dict(os.environ)
        # A name sent once is sent every time (set back to its start value, the ranks must follow too).
        changed = {k: v for k, v in now.items() if self._env_at_start.get(k) != v or k in self._env_sent}
        removed = [k for k in {*self._env_at_start, *self._env_sent} if k not in now]
        self._env_sent.update(changed)
        own = set(self.settings.env)  # the session's env=: the ranks keep it, as a one-off call's would
        kept = sorted(k for k in [*changed, *removed] if k in own or env_names.kept_by_the_ranks(k))
        for name in kept:
            if name not in self._kept_said:
                self._kept_said.add(name)
                print(
                    f"air_magic: the session's ranks keep their own {name} (set when the session "
                    "started); a one-off call, outside the session, takes the notebook's new value",
                    file=sys.stderr,
                )
        return {
            "cwd": os.getcwd(),
            "sys_path": list(sys.path),
            "env": {k: v for k, v in changed.items() if k not in kept},
            "unset": [k for k in removed if k not in kept],
        }

    def _follow(self, cell: _Cell, limit: float | None) -> tuple[str, BaseException | None]:
        """Wait for every rank's answer; interrupt the stragglers after an error or the timeout."""
        deadline = None if limit is None else cell.started + limit
        everyone = self._everyone_answered(cell)

        def done_or_overdue() -> bool:
            overdue = (
                cell.first_error_at is not None and time.monotonic() - cell.first_error_at > PEER_GRACE_S
            )
            return everyone() or overdue

        in_time = self._pump(cell, done_or_overdue, deadline)
        if self._finished is not None:
            ended = self._session_error(f"during {cell.name}")
            if any(record is not None for record in cell.records.values()):
                # A rank raised before the session ended (a CUDA error, then a peer's abort): the
                # rank's own exception is the root cause; the end is said beside it.
                print(f"air_magic: {str(ended).splitlines()[0]}", file=sys.stderr)
                return "failed", self._cell_error(cell)
            return "failed", ended
        if not in_time:
            running = self._still_in(cell)
            stacks = self._stacks(running)
            tails = {r: self._tails[r].last(5) for r in running}  # before the interrupt's traceback
            recovered = self._interrupt(cell)
            return "timeout", self._timeout_error(cell, limit or 0.0, tails, stacks, recovered)
        if not everyone():
            self._interrupt(cell)  # the others are likely waiting for the failed rank in a collective
        if self._finished is None and all(cell.answers.get(r) for r in range(self.world_size)):
            return "succeeded", None
        return "failed", self._cell_error(cell)

    def _interrupt(self, cell: _Cell) -> bool:
        """SIGINT to every rank still in the cell; True if each reported it in time (the session
        lives on), else the session ends."""
        running = self._still_in(cell)
        if self._finished is not None:
            return False
        if self._sender is not None:
            self._sender.interrupt(running)  # the backend skips a rank whose process has ended
        cell.interrupted = running
        try:
            recovered = self._pump(cell, self._everyone_answered(cell), time.monotonic() + RECOVER_S)
        except KeyboardInterrupt:  # a second Ctrl-C: no more waiting
            recovered = False
        if recovered and self._finished is None:
            return True
        if self._finished is None:
            late = self._still_in(cell)
            self._end(
                f"rank(s) {', '.join(map(str, late))} did not stop {cell.name} within {RECOVER_S:g} s of "
                "SIGINT (a rank blocked in a collective or in C code cannot be interrupted)"
            )
        print(f"air_magic: session {self.id} ended: {self.ended_why}. Every rank is gone.", file=sys.stderr)
        return False

    # -- waiting, on the caller's thread -----------------------------------------------------

    def _pump(self, cell: _Cell, until: Callable[[], bool], deadline: float | None) -> bool:
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

    def _deliver(self, cell: _Cell, item: tuple[Any, ...]) -> None:
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
            _, rank, message, outcome = item
            if message.get("ready"):
                if cell.number == 0:
                    cell.answers[rank] = True
                    cell.bus.emit(
                        RankExited(rank=rank, state=RankState.SUCCEEDED, exit_code=None, reason="ready")
                    )
                return
            if message.get("cell") != cell.number:
                return  # an answer to a cell that already ended (it came after the session gave up)
            ok = bool(message.get("ok"))
            cell.answers[rank] = ok
            if ok:
                cell.results[rank] = outcome
            else:
                cell.records[rank] = _load_record(outcome)
                if cell.first_error_at is None:
                    cell.first_error_at = time.monotonic()
            if ok:
                reason, state = "returned", RankState.SUCCEEDED
            elif rank in cell.interrupted:
                reason, state = "interrupted (SIGINT)", RankState.KILLED
            else:
                reason, state = "raised an exception", RankState.FAILED
            cell.bus.emit(RankExited(rank=rank, state=state, exit_code=None, reason=reason))

    def _everyone_answered(self, cell: _Cell) -> Callable[[], bool]:
        return lambda: len(cell.answers) == self.world_size

    def _still_in(self, cell: _Cell) -> list[int]:
        return [r for r in range(self.world_size) if r not in cell.answers]

    def _close_cell(self, cell: _Cell, outcome: str, error: BaseException | None) -> None:
        """The cell's end, for its display and history; its files go."""
        if self._finished is not None or self.state == "ended":
            self._drain_queue(cell)  # what the ranks printed as they were stopped, and their ends
        with self._lock:
            self._current = None
        if cell.number:
            cell.bus.emit(self._state_event(cell.number))
        failed_rank = None
        if outcome == "failed":
            failed = [r for r, ok in cell.answers.items() if not ok and r not in cell.interrupted]
            failed_rank = min(failed) if failed else None
        cell.bus.emit(
            RunFinished(
                run_id=f"{self.id}.{cell.number}",
                outcome=outcome,
                elapsed=time.monotonic() - cell.started,
                log_dir=self.log_dir or "",
                error=None if error is None else f"{type(error).__name__}: {error}",
                failed_rank=failed_rank,
            )
        )
        self._log_step_once(cell, outcome)
        if cell.number and outcome != "succeeded":
            self._failed_cells.append((cell.number, f"{type(error).__name__}: {error}" if error else outcome))

    def _drain_queue(self, cell: _Cell) -> None:
        if self._thread is not None:
            self._thread.join(5.0)  # every event of the session's end is in the queue then
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            self._deliver(cell, item)

    # -- outcomes ---------------------------------------------------------------------------

    def _results(self, cell: _Cell) -> list[Any]:
        missing = [rank for rank in range(self.world_size) if rank not in cell.results]
        if missing:
            raise LaunchError(f"rank {missing[0]} answered {cell.name} but its result is missing")
        return load_results(None, [(rank, cell.results[rank]) for rank in range(self.world_size)])

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """The thread stacks of these ranks, from the backend (on this machine or the nodes')."""
        prepared = self._prepared
        if prepared is None:
            return {}
        try:
            return {r: text for r, text in prepared.backend.stacks().items() if r in ranks}
        except Exception:  # noqa: BLE001 - stacks are a help; the timeout's error goes out anyway
            return {}

    def _records(self, cell: _Cell) -> list[RankFailure]:
        failures = []
        for rank, record in sorted(cell.records.items()):
            if record is None:
                continue
            # A rank interrupted because another failed: a consequence, never the root cause.
            failures.append(
                RankFailure.of(rank, record.time, None, record, consequence=rank in cell.interrupted)
            )
        return failures

    def _cell_error(self, cell: _Cell) -> BaseException:
        failures = self._records(cell)
        if not failures:
            return LaunchError(f"{cell.name} failed without an error record (logs: {self.log_dir})")
        run = self._run_started
        return build_exception(
            failures,
            world_size=self.world_size,
            log_path=lambda rank: paths.rank_log(self.log_dir or "", rank),
            last_lines=lambda rank: self._tails[rank].last(10),
            cpu_mode=run is not None and run.cpu_mode,
        )

    def _timeout_error(
        self, cell: _Cell, limit: float, tails: dict[int, list[str]], stacks: dict[int, str], recovered: bool
    ) -> DistributedTimeoutError:
        kept = (
            f"the cell was interrupted on every rank and session {self.id} goes on"
            if recovered
            else f"session {self.id} ended: {self.ended_why}"
        )
        rows = [(rank, tail, False) for rank, tail in tails.items()]
        return timeout_error(limit, rows, stacks, self.log_dir or "", subject=cell.name, then=kept)

    def _session_error(self, when: str) -> SessionEndedError:
        """The session's own end (a rank died, or it was stopped), as the cell that saw it raises it."""
        if self._thread is not None:
            self._thread.join(10.0)
        self.state = "ended"
        cause = self._result.error if self._result is not None else self._error
        why = self.ended_why or "its ranks are gone"
        if cause is not None:
            why = f"{type(cause).__name__}: {cause}"
            self.ended_why = why.splitlines()[0]
        error = SessionEndedError(
            f"session {self.id} ended {when}: {why}\nEvery rank is gone; "
            "%distributed session start (or air_magic.session()) begins a new one."
        )
        error.__cause__ = cause
        return error

    def _check_usable(self) -> None:
        if self.state == "ended" and self._finished is None and self.ended_why is None:
            raise self._session_error("between cells")  # a rank died while no cell ran
        if self.state != "ready":
            raise SessionEndedError(
                f"session {self.id} is {self.state}"
                + (f" ({self.ended_why})" if self.ended_why else "")
                + "; %distributed session start begins a new one"
            )
        # Ended between cells (a rank died): the queue holds the end.
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item[0] == "event" and isinstance(item[1], RunFinished):
                self._finished = item[1]
        if self._finished is not None or (self._thread is not None and not self._thread.is_alive()):
            raise self._session_error("between cells")

    # -- the loop's thread: events and answers, into the queue ------------------------------

    def handle(self, event: Event) -> None:
        """A consumer of the session call's events (the backend's loop thread)."""
        if isinstance(event, RunStarted):
            self._run_started = event
            self.log_dir = event.log_dir
            prepared = self._prepared
            tracked = prepared.run_start.tracked if prepared and prepared.run_start else None
            self.record = tracked.link() if tracked is not None else None
            current = self._current
            if current is not None:
                for display in current.bus._consumers:
                    if hasattr(display, "set_record"):
                        display.set_record(self.record)
        elif isinstance(event, RankStarted):
            self._pids[event.rank] = event.pid
        elif isinstance(event, RankOutput):
            self._tails[event.rank].add(event.text)
        elif isinstance(event, RankExited):
            self._ended_ranks[event.rank] = event.reason or event.state.value
        elif isinstance(event, Tick):
            return  # the cell's own ticks come from the caller's thread
        with self._lock:
            current = self._current
        if isinstance(event, RunFinished) and event.outcome == "succeeded" and self._failed_cells:
            # Its ranks ended well, but not every cell did: `air-magic runs` must not say succeeded.
            first, why = self._failed_cells[0]
            history.amend(
                self.id,
                outcome="failed",
                error=f"{len(self._failed_cells)} of {self.cells} cell(s) failed; "
                f"the first, cell {first}: {why}",
            )
        if isinstance(event, RunFinished) and current is not None:
            # The session ends under a cell: its step goes in before the run's end (queued next,
            # on this thread), which the cell's own end, on the caller's thread, comes after.
            self._log_step_once(current, "failed")
        if current is not None or isinstance(event, (RankExited, RunFinished)):
            self._queue.put(("event", event))

    def connect(self, sender: CellSender) -> None:
        """The backend's line to the ranks, before any rank starts (CellChannel)."""
        self._sender = sender

    def answered(self, rank: int, answer: dict[str, Any], outcome: bytes | None) -> None:
        """A rank's answer, after everything it printed before it (the backend's thread)."""
        self._memory[rank] = answer.get("memory") or {}
        self._queue.put(("answer", rank, answer, outcome))

    # -- the session's own thread -----------------------------------------------------------

    def _serve(self) -> None:
        prepared = self._prepared
        assert prepared is not None
        try:
            self._result = prepared.run([], [self])
        except BaseException as exc:  # noqa: BLE001 - handed to the cell that asks
            self._error = exc
        finally:
            self.state = "ended"
            if self.ended_why is None:  # a rank died between cells: why, for status and the next cell
                cause = self._result.error if self._result is not None else self._error
                if cause is not None:
                    self.ended_why = f"{type(cause).__name__}: {cause}".splitlines()[0]
            self._queue.put(("event", RunFinished(self.id, "ended", 0.0, self.log_dir or "")))

    def _end(self, why: str) -> None:
        """Stop every rank now (the session's loop stops them as it stops a call)."""
        self.ended_why = why
        self._stop_ranks()
        self.state = "ended"
        global _active
        with _active_lock:
            if _active is self:
                _active = None

    def _stop_ranks(self) -> None:
        prepared = self._prepared
        if prepared is not None:
            prepared.backend.stop()
        if self._thread is not None:
            self._thread.join(15.0)

    # -- header and MLflow -------------------------------------------------------------------

    def _state_event(self, cells: int) -> SessionState:
        ranks = tuple(
            (rank, self._pids.get(rank, 0), memory_words(self._memory.get(rank)))
            for rank in range(self.world_size)
        )
        return SessionState(session_id=self.id, cells=cells, ranks=ranks)

    def _tracked(self) -> Any:
        prepared = self._prepared
        return prepared.run_start.tracked if prepared is not None and prepared.run_start else None

    def _track_cell_source(self, number: int, kind: str, source: str | None) -> None:
        """The cell's code in the session's MLflow run, ``cells/cell-NNNN.py`` (queued: no wait here)."""
        tracked = self._tracked()
        if tracked is None or source is None:
            return
        suffix = "py" if kind in ("cell", "function") else "txt"
        tracked.jobs.put(
            functools.partial(
                tracked.client.log_text, tracked.run_id, source, f"cells/cell-{number:04d}.{suffix}"
            )
        )

    def _log_step_once(self, cell: _Cell, outcome: str) -> None:
        """One step per cell in the session's run: how long it took and whether it succeeded."""
        with self._lock:
            if cell.logged or not cell.number:
                return
            cell.logged = True
        tracked = self._tracked()
        if tracked is None:
            return
        seconds = time.monotonic() - cell.started
        tracked.jobs.put(
            functools.partial(_log_cell, tracked.client, tracked.run_id, cell.number, outcome, seconds)
        )


def _log_cell(client: Any, run_id: str, number: int, outcome: str, seconds: float) -> None:
    """A cell's step in the session's run, in one write (on the MLflow run's owner thread)."""
    from mlflow.entities import Metric, RunTag

    now = int(time.time() * 1000)
    client.log_batch(
        run_id,
        metrics=[
            Metric("air_magic.cell_seconds", seconds, now, number),
            Metric("air_magic.cell_succeeded", float(outcome == "succeeded"), now, number),
        ],
        tags=[RunTag("air_magic.cells", str(number))],
    )


def _load_record(data: bytes | None) -> Any:
    try:
        return serialization.loads(data) if data is not None else None
    except Exception:  # noqa: BLE001 - a torn record: the rank's log still has the traceback
        return None


def memory_words(memory: dict[str, int] | None) -> str:
    """What a rank holds, in words: CUDA memory torch allocated (and reserved), else resident memory."""
    if not memory:
        return "memory not known yet"
    if "gpu" in memory:
        return (
            f"{_size(memory['gpu'])} GPU memory in use ({_size(memory.get('gpu_reserved', 0))} reserved) "
            f"on cuda:{memory.get('device', 0)}"
        )
    return f"{_size(memory.get('rss', 0))} resident (no CUDA in use)"


def _size(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.0f} MiB"


def session(**settings: Any) -> Session:
    """A persistent session with these launch settings (the decorator's keywords), not yet started.

    ``with air_magic.session(num_accelerators=2) as s:`` starts it, makes it the
    session ``%%distributed`` cells run in, and stops it at the block's end;
    ``s.run(fn, *args)`` and ``s.run_cell(source)`` run code in its ranks.
    """
    return Session(make_settings(**settings))
