"""A persistent session's long call: its ranks' life, its line to them, what it knows of them.

``calls/persistent.Session`` is made of this and ``calls/cell_loop.CellLoop``
(which runs the cells, on the caller's thread). The session is one long call
whose function is ``worker/session_rank.serve``, prepared and run like any
call (``calls/call.py``: the accelerator plan, the GPU claim, one MLflow run,
the backend's loop with its lifeline, pidfds and teardown, locally or on Ray),
on a thread of its own. :class:`SessionCall` is the request's ``CellChannel``
(``launch/request.py``): before any rank starts the backend hands it a
``CellSender``; from the backend's thread come the call's events
(:meth:`handle`), among them each rank's answer to a cell (``CellAnswered``),
after everything that rank printed before it. Both go, typed (:class:`FromLoop`,
:class:`Answer`), into one queue that the cell loop empties on the caller's
thread.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import queue
import sys
import threading
from dataclasses import dataclass
from typing import Any, Protocol

from air_magic import paths
from air_magic.backends.base import Backend
from air_magic.backends.output import RankTail
from air_magic.calls import call
from air_magic.calls.session_cell import SessionCell
from air_magic.errors import SessionEndedError
from air_magic.launch.request import CellSender, RunResult, new_call_id
from air_magic.launch.settings import LaunchSettings
from air_magic.protocol import events
from air_magic.protocol.events import Event, EventBus, Outcome, RecordLink, RunFinished, SessionState
from air_magic.protocol.words import Word
from air_magic.worker import session_rank

SLOW_STOP_S = 2.0  # after this long, a stop that waits on its ranks says why
END_GRACE_S = 1.0  # when the session's ranks are stopped at last: SIGINT, then SIGKILL after this


class SessionStatus(Word):
    """A session's life: NEW -> STARTING -> READY -> ENDED (a str: ``state == "ready"`` still works)."""

    NEW = "new"
    STARTING = "starting"
    READY = "ready"
    ENDED = "ended"


@dataclass(frozen=True)
class FromLoop:
    """An event of the session's call, from the backend's loop thread."""

    event: Event


@dataclass(frozen=True)
class Answer:
    """A rank's answer to a cell (or its ``ready``), after everything it printed before it."""

    rank: int
    message: dict[str, Any]
    outcome: bytes | None  # the cell's pickled value (ok) or error record (not ok)


Delivered = FromLoop | Answer


class Cells(Protocol):
    """What the session call asks of whoever runs its cells (``calls/cell_loop.CellLoop``)."""

    current: SessionCell | None  # the cell running, if one is

    def log_step_once(self, cell: SessionCell, outcome: Outcome) -> None: ...

    def outcome(
        self, outcome: Outcome, error: str | None, failed_rank: int | None
    ) -> tuple[Outcome, str | None, int | None]: ...


class SessionCall:
    """The session's long call: start it, stop it, and what its ranks said (the CellChannel)."""

    def __init__(self, settings: LaunchSettings, name: str, backend: Backend | None = None):
        self.settings = settings
        self.name = name
        self.id = new_call_id()
        self.state = SessionStatus.NEW
        self.world_size = 0
        self.ended_why: str | None = None
        self.log_dir: str | None = None
        self.record: RecordLink | None = None  # the tracked run's link
        self.run_started: events.RunStarted | None = None
        self.finished: RunFinished | None = None  # the session's own end, once the caller saw it
        self.sender: CellSender | None = None  # the backend's line to the ranks (connect())
        self.pids: dict[int, int] = {}
        self.memory: dict[int, dict[str, int]] = {}
        self.tails: list[RankTail] = []  # each rank's last lines of the cell running (new per cell)
        self.ended_ranks: dict[int, str] = {}  # rank -> how it ended (status shows no memory for it)
        self.ended_in_cell: int | None = None  # the cell the session ended under, if it did
        self.cells: Cells | None = None  # who runs the cells: asked for the current cell and outcome
        self.prepared: call.PreparedCall | None = None
        self.given_backend = backend  # the one to run it with (a test's scripted backend), else the runner's
        self._thread: threading.Thread | None = None
        self._queue: queue.SimpleQueue[Delivered] = queue.SimpleQueue()
        self._result: RunResult | None = None
        self._error: BaseException | None = None

    # -- life ---------------------------------------------------------------------------------

    def launch(self) -> SessionCell:
        """Prepare the call and start it on its own thread; the start's cell (number 0) to follow."""
        func = session_rank.serve
        # The cells have the timeouts. The call's own stop comes only once the session has given its
        # ranks their chance (a stop's wait, an interrupt's recovery): then a short grace.
        settings = dataclasses.replace(self.settings, timeout=None, stop_grace=END_GRACE_S)
        # Named with its id: the run's name, and what a call refused its GPUs is told holds them.
        prepared = call.prepare_call(
            f"{self.name} {self.id}",
            func,
            inspect.signature(func).bind(),
            settings,
            kind="session",
            backend=self.given_backend,
        )
        prepared.channel = self
        prepared.call_id = self.id
        self.prepared = prepared
        self.world_size = prepared.plan.world_size
        self.reset_tails()
        self.state = SessionStatus.STARTING
        start = SessionCell(
            0, f"{self.name} {self.id} (start)", EventBus(prepared.displays()), self.world_size
        )
        assert self.cells is not None
        self.cells.current = start
        self._thread = threading.Thread(target=self._serve, name=f"air_magic-session-{self.id}", daemon=True)
        try:
            self._thread.start()
        except BaseException:
            prepared.abandon()
            self.state = SessionStatus.ENDED
            raise
        return start

    def running(self) -> bool:
        """Its call's thread is still on (the ranks may be up)."""
        return self._thread is not None and self._thread.is_alive()

    def started(self) -> bool:
        return self._thread is not None

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def alive(self) -> bool:
        return self.state == SessionStatus.READY and not (self._thread is not None and not self.running())

    def ask_to_stop(self) -> None:
        """Each rank leaves its loop (its process group ends) at the next chance."""
        self.ended_why = self.ended_why or "stopped"
        if self.sender is not None:
            self.sender.send_stop()

    def interrupt_the_running_cell(self) -> SessionCell | None:
        """A stop while a cell runs (from another thread, or the kernel's exit): the ranks still in
        it get SIGINT, as on Ctrl-C, so they leave it and then their loop; the cell says it was
        stopped. None: no cell runs."""
        cell = self.cells.current if self.cells is not None else None
        if cell is None or not cell.number or self.sender is None:
            return None
        running = cell.still_in()
        cell.stopped = True
        cell.interrupted = [*cell.interrupted, *running]  # their KeyboardInterrupt is ours
        if running:
            self.sender.interrupt(running)
        return cell

    def stopped_error(self, cell: SessionCell) -> SessionEndedError:
        """What the cell that ran while the session was stopped raises."""
        return SessionEndedError(
            f"session {self.id} was stopped while {cell.name} ran (cell {cell.number}): its ranks "
            "were interrupted (SIGINT) and every rank is gone; %distributed session start (or "
            "air_magic.session()) begins a new one."
        )

    def end(self, why: str) -> None:
        """Stop every rank now (the session's loop stops them as it stops a call)."""
        self.ended_why = why
        self.stop_ranks()
        self.state = SessionStatus.ENDED

    def _backend(self) -> Backend | None:
        return self.prepared.backend if self.prepared is not None else None

    def stop_ranks(self) -> None:
        backend = self._backend()
        if backend is not None:
            backend.stop()
        self.join(15.0)

    def say_why_slow(self, wait_s: float) -> None:
        """Ranks that have not ended SLOW_STOP_S after the stop: usually a thread that is not a daemon
        (Python waits for it before a process ends). Said, with their stacks, not waited in silence."""
        left = sorted(r for r in self.pids if r not in self.ended_ranks)
        where = ""
        backend = self._backend()
        if backend is not None and self.log_dir:
            try:
                backend.stacks()  # every thread of every rank, into stacks.txt
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

    def say_stuck_in(self, cell: SessionCell, waited_s: float) -> None:
        """A stop's SIGINT did not end ``cell`` on some ranks: said, before they are stopped."""
        print(
            f"air_magic: session {self.id}: rank(s) {', '.join(map(str, cell.still_in()))} did not "
            f"leave cell {cell.number} within {waited_s:g} s of SIGINT (a rank blocked in a collective "
            "or in C code cannot be interrupted); they are stopped now",
            file=sys.stderr,
            flush=True,
        )

    def stacks(self, ranks: list[int]) -> dict[int, str]:
        """The thread stacks of these ranks, from the backend (on this machine or the nodes')."""
        backend = self._backend()
        if backend is None:
            return {}
        try:
            return {r: text for r, text in backend.stacks().items() if r in ranks}
        except Exception:  # noqa: BLE001 - stacks are a help; the timeout's error goes out anyway
            return {}

    def error(self, when: str) -> SessionEndedError:
        """The session's own end (a rank died, or it was stopped), as the cell that saw it raises it."""
        self.join(10.0)
        self.state = SessionStatus.ENDED
        cause = self._cause()
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

    def _cause(self) -> BaseException | None:
        return self._result.error if self._result is not None else self._error

    def _serve(self) -> None:
        prepared = self.prepared
        assert prepared is not None
        try:
            self._result = prepared.run([], [self])
        except BaseException as exc:  # noqa: BLE001 - handed to the cell that asks
            self._error = exc
        finally:
            self.state = SessionStatus.ENDED
            cause = self._cause()
            if self.ended_why is None and cause is not None:  # a rank died between cells: for status
                self.ended_why = f"{type(cause).__name__}: {cause}".splitlines()[0]
            self._queue.put(FromLoop(RunFinished(self.id, Outcome.SESSION_ENDED, 0.0, self.log_dir or "")))

    # -- the queue, on the caller's thread -----------------------------------------------------

    def next_item(self, timeout: float | None) -> Delivered | None:
        """The next event or answer (None: none came within ``timeout``; 0: none waiting)."""
        try:
            if timeout == 0:
                return self._queue.get_nowait()
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def raise_if_unusable(self) -> None:
        """Raise why no cell can run now (the session ended, between cells or before)."""
        if self.state == SessionStatus.ENDED and self.finished is None and self.ended_why is None:
            raise self.error("between cells")  # a rank died while no cell ran
        if self.state == SessionStatus.NEW:
            raise SessionEndedError(
                f"session {self.id} is not started: s.start() starts it (or `with air_magic.session(...) "
                "as s:`, or %distributed session start)"
            )
        if self.state != SessionStatus.READY:
            raise SessionEndedError(
                f"session {self.id} is {self.state}"
                + (f" ({self.ended_why})" if self.ended_why else "")
                + "; %distributed session start begins a new one"
            )
        # Ended between cells (a rank died): the queue holds the end.
        while (item := self.next_item(0)) is not None:
            if isinstance(item, FromLoop) and isinstance(item.event, RunFinished):
                self.finished = item.event
        if self.finished is not None or (self.started() and not self.running()):
            raise self.error("between cells")

    def reset_tails(self) -> None:
        """A new cell's own last lines: its error never quotes what an earlier cell printed."""
        self.tails = [RankTail() for _ in range(self.world_size)]

    def last_lines(self, rank: int, n: int) -> list[str]:
        """The channel's side (launch/request.CellChannel): the session's end quotes these too."""
        tails = self.tails
        return tails[rank].last(n) if 0 <= rank < len(tails) else []

    def state_event(self, cells: int) -> SessionState:
        ranks = tuple(
            (rank, self.pids.get(rank, 0), memory_words(self.memory.get(rank)))
            for rank in range(self.world_size)
        )
        return SessionState(session_id=self.id, cells=cells, ranks=ranks)

    def tracked(self) -> Any:
        prepared = self.prepared
        return prepared.run_owner.tracked if prepared is not None and prepared.run_owner else None

    # -- the CellChannel, on the backend's loop thread ----------------------------------------

    def handle(self, event: Event) -> None:
        """A consumer of the session call's events."""
        current = self.cells.current if self.cells is not None else None
        if isinstance(event, events.CellAnswered):  # after everything that rank printed before it
            self.memory[event.rank] = event.answer.get("memory") or {}
            self._queue.put(Answer(event.rank, event.answer, event.outcome))
            return
        if isinstance(event, RecordLink):  # the session's MLflow run: its cells' displays show it
            self.record = event
        elif isinstance(event, events.RunStarted):
            self.run_started = event
            self.log_dir = event.log_dir
        elif isinstance(event, events.RankStarted):
            self.pids[event.rank] = event.pid
        elif isinstance(event, events.RankOutput):
            self.tails[event.rank].add(event.text)
        elif isinstance(event, events.RankExited):
            self.ended_ranks[event.rank] = event.reason or event.state.value
        elif isinstance(event, events.Tick):
            return  # the cell's own ticks come from the caller's thread
        if isinstance(event, RunFinished) and current is not None and self.cells is not None:
            # The session ends under a cell: its step goes in before the run's end (queued next,
            # on this thread), which the cell's own end, on the caller's thread, comes after.
            self.cells.log_step_once(current, Outcome.FAILED)
        if current is not None or isinstance(event, (events.RankExited, RunFinished)):
            self._queue.put(FromLoop(event))

    def connect(self, sender: CellSender) -> None:
        """The backend's line to the ranks, before any rank starts."""
        self.sender = sender

    def own_outcome(
        self, outcome: Outcome, error: str | None, failed_rank: int | None
    ) -> tuple[Outcome, str | None, int | None]:
        """The session's outcome, said once in its call's RunFinished: a rank's own death is its
        end (FAILED, the ledger's error); otherwise its cells' (``CellLoop.outcome``)."""
        if outcome == Outcome.FAILED or self.cells is None:
            return outcome, error, failed_rank
        return self.cells.outcome(outcome, error, failed_rank)


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
