"""A persistent session (SPEC §15): ranks that stay up between cells and keep their globals.

The session is one long call; this module is its life (start, stop, status, the
backend's events and answers into one queue), ``calls/cell_loop.py`` runs its
cells, ``calls/held_names.py`` keeps what the ranks hold of the notebook's.
The session is one long call. Its function is ``worker/session_rank.serve``; it
is prepared and run like any call (``calls/call.py``: the accelerator plan,
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
import inspect
import os
import queue
import sys
import threading
import time
from typing import Any

from air_magic import paths
from air_magic.backends.output import RankTail
from air_magic.calls import call
from air_magic.calls.cell_loop import CellLoop
from air_magic.calls.held_names import CallerChanges, HeldNames
from air_magic.calls.session_cell import SessionCell
from air_magic.errors import ConfigurationError, SessionEndedError
from air_magic.launch.failures import root_cause_rank
from air_magic.launch.request import CellSender, RunResult, new_run_id
from air_magic.launch.settings import LaunchSettings, make_settings
from air_magic.protocol.events import (
    Event,
    EventBus,
    Outcome,
    RankExited,
    RankOutput,
    RankStarted,
    RunFinished,
    RunStarted,
    SessionState,
    Tick,
)
from air_magic.worker import session_rank

STOP_WAIT_S = 10.0  # `session stop`: how long the ranks get to end on their own before they are stopped
SLOW_STOP_S = 2.0  # after this long, a stop that waits on its ranks says why
END_GRACE_S = 1.0  # when the session's ranks are stopped at last: SIGINT, then SIGKILL after this

_active: Session | None = None
_last: Session | None = None  # the newest session started, running or not (%distributed session status)
_active_lock = threading.Lock()


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


class Session(CellLoop):
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
        self.record = None  # the tracked run's link (its type: CellLoop's)
        self._prepared: call.PreparedCall | None = None
        self._thread: threading.Thread | None = None
        self._queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._busy = threading.Lock()  # one cell at a time
        self._current: SessionCell | None = None
        self._finished: RunFinished | None = None  # the session's own end, once the caller saw it
        self._result: RunResult | None = None
        self._error: BaseException | None = None
        self._run_started: RunStarted | None = None
        self._pids: dict[int, int] = {}
        self._memory: dict[int, dict[str, int]] = {}
        self._tails: list[RankTail] = []  # each rank's last lines of the cell running (new per cell)
        self._ended_ranks: dict[int, str] = {}  # rank -> how it ended (status shows no memory for it)
        # (cell, why, its root cause's rank), for the session's own outcome
        self._failed_cells: list[tuple[int, str, int | None]] = []
        self._sender: CellSender | None = None  # the backend's line to the ranks (connect())
        self.names = HeldNames()  # what the ranks hold of the notebook's (notebook/magics.py asks)
        self._caller = CallerChanges(self.id, settings.env)  # what changed in the notebook since the start

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
        displays = prepared.displays()
        start = SessionCell(
            0, f"{self.name} {self.id} (start)", EventBus(displays), self.world_size, displays
        )
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
            if not self._pump(start, start.everyone_answered, deadline):
                self._end(f"its ranks were not ready within {limit:g} s (timeout=)")
                error = SessionEndedError(
                    f"session {self.id} did not start: {self.ended_why}; every rank is gone"
                )
                self._close_cell(start, Outcome.TIMEOUT, error)
                raise error
        except KeyboardInterrupt:
            self._end("interrupted while it started")
            self._close_cell(start, Outcome.INTERRUPTED, None)
            raise
        if self._finished is not None:
            error = self._session_error("while it started")
            self._close_cell(start, Outcome.FAILED, error)
            raise error
        if not self._thread.is_alive():
            error = self._session_error("while it started")
            self._close_cell(start, Outcome.FAILED, error)
            raise error
        self.state = "ready"
        start.bus.emit(self._state_event(0))
        self._close_cell(start, Outcome.SUCCEEDED, None)
        with _active_lock:
            _active = self
        return self

    def stop(self, wait_s: float = STOP_WAIT_S, quiet: bool = False) -> None:
        """End the session: each rank leaves its loop (its process group ends), then every process
        is gone. Safe to call twice."""
        self.names.clear()  # the notebook's objects are its own again (and not kept alive here)
        self._deactivate()
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

    # -- names between the notebook and the ranks (calls/held_names.py) ---------------------

    def held_by_ranks(self, name: str, value: Any) -> bool:
        return self.names.held_by_ranks(name, value)

    def note_held(self, names: dict[str, Any]) -> None:
        self.names.note(names)

    def forget(self, names: list[str]) -> None:
        self.names.forget(names)

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
            self.record = prepared.record if prepared is not None else None  # the call's tracked run
            current = self._current
            if current is not None:
                for display in current.displays:
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
        if isinstance(event, RunFinished) and current is not None:
            # The session ends under a cell: its step goes in before the run's end (queued next,
            # on this thread), which the cell's own end, on the caller's thread, comes after.
            self._log_step_once(current, Outcome.FAILED)
        if current is not None or isinstance(event, (RankExited, RunFinished)):
            self._queue.put(("event", event))

    def connect(self, sender: CellSender) -> None:
        """The backend's line to the ranks, before any rank starts (CellChannel)."""
        self._sender = sender

    def own_outcome(
        self, outcome: Outcome, error: str | None, failed_rank: int | None
    ) -> tuple[Outcome, str | None, int | None]:
        """The session's outcome, said once in its call's RunFinished, which `air-magic runs` and its
        MLflow run both read. A rank's own death is the session's end (FAILED, the ledger's error).
        Otherwise a cell that failed makes the session failed: one whose ranks then ended well (its
        cells counted), or one that ended under it (its ranks stopped, not recovered from an error
        in a collective: that cell's root cause, not the stop)."""
        if outcome == Outcome.FAILED:
            return outcome, error, failed_rank
        current = self._current
        if current is not None and current.number and current.raised_on_its_own():
            cause = self._cell_error(current)
            said = f"{current.name} failed: {type(cause).__name__}: {cause}"
            return Outcome.FAILED, said, root_cause_rank(cause)
        if not self._failed_cells:
            return outcome, error, failed_rank
        first, why, rank = self._failed_cells[0]
        count = f"{len(self._failed_cells)} of {self.cells} cell(s) failed; the first, cell {first}: {why}"
        return Outcome.FAILED, count, rank

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
            self._queue.put(("event", RunFinished(self.id, Outcome.SESSION_ENDED, 0.0, self.log_dir or "")))

    def _end(self, why: str) -> None:
        """Stop every rank now (the session's loop stops them as it stops a call)."""
        self.ended_why = why
        self._stop_ranks()
        self.state = "ended"
        self._deactivate()

    def _deactivate(self) -> None:
        """No longer the session cells run in (its end was said, or it is stopping)."""
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
        return prepared.run_owner.tracked if prepared is not None and prepared.run_owner else None


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
