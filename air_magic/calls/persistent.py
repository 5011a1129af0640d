"""A persistent session (SPEC §15): ranks that stay up between cells and keep their globals.

:class:`Session`, what the user holds, is made of two parts that it composes:

- ``calls/session_call.SessionCall``: the session's one long call (its function is
  ``worker/session_rank.serve``, prepared and run like any call on a thread of its
  own), its state (:class:`SessionStatus`), the request's ``CellChannel`` and the
  typed queue of the call's events and the ranks' answers;
- ``calls/cell_loop.CellLoop``: its cells, on the caller's thread (send, follow,
  interrupt, close), each cell's display and history fed in order from that queue.

This module keeps which session ``%%distributed`` cells run in (:func:`active`,
:func:`for_cell`), ``calls/held_names.py`` what the ranks hold of the notebook's.

Failures: a rank that raises reports like a call's rank (its exception and
traceback) and lives on. After the first error the others get ``PEER_GRACE_S``
to finish the cell; then, as on Ctrl-C or a cell's timeout, the ranks still in
the cell get SIGINT and ``RECOVER_S`` to report. If every rank does, the
session lives on; if not, or if a rank dies, the session ends (every rank
stopped, as at the end of a call) and says why. The kernel's exit stops it
(``call.on_exit``); its death takes the ranks with the lifeline. Decisions:
docs/session.md.
"""

from __future__ import annotations

import inspect
import operator
import sys
import threading
from collections.abc import Callable
from typing import Any

from air_magic.backends.base import Backend
from air_magic.calls import call, cell_loop, runners
from air_magic.calls.cell_loop import CellLoop
from air_magic.calls.held_names import CallerChanges, HeldNames
from air_magic.calls.session_call import SLOW_STOP_S, SessionCall, SessionStatus, memory_words
from air_magic.errors import ConfigurationError, SessionEndedError
from air_magic.launch.request import RunResult
from air_magic.launch.settings import LaunchSettings, make_settings
from air_magic.protocol import serialization
from air_magic.worker import cell_runner

__all__ = [
    "Session",
    "SessionEndedError",
    "SessionStatus",
    "active",
    "for_cell",
    "last",
    "memory_words",
    "session",
]

STOP_WAIT_S = 10.0  # `session stop`: how long the ranks get to end on their own before they are stopped

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


class Session:
    """A persistent session: start it, run cells and functions in it, stop it.

    ``with air_magic.session(num_accelerators=2) as s:`` starts it and makes it the
    active session (``%%distributed`` cells run in it); ``s.run(fn, *args)`` runs a
    function on every rank and returns every rank's value; the block's end stops it.
    Made of its long call (``calls/session_call.SessionCall``: the ranks' life and the
    line to them) and the loop that runs its cells (``calls/cell_loop.CellLoop``).
    """

    def __init__(self, settings: LaunchSettings, name: str = "session", backend: Backend | None = None):
        if runners.outlives_caller(settings):
            raise ConfigurationError("a persistent session lives in this process: detach=True is not for it")
        self._compose(settings, name, backend)

    def _compose(self, settings: LaunchSettings, name: str, backend: Backend | None) -> None:
        """Its parts, new: at its making, and at a restart (the same object, new ranks)."""
        self.call = SessionCall(settings, name, backend)
        self.names = HeldNames()  # what the ranks hold of the notebook's (notebook/magics.py asks)
        self.loop = CellLoop(self.call, CallerChanges(self.call.id, settings.env), self._deactivate)

    # What the session is, in its call's words (read-only).
    settings = property(operator.attrgetter("call.settings"), doc="its launch settings")
    name = property(operator.attrgetter("call.name"))
    id = property(operator.attrgetter("call.id"), doc="its call's id (its log folder's name)")
    state = property(operator.attrgetter("call.state"), doc="a SessionStatus: new, starting, ready, ended")
    world_size = property(operator.attrgetter("call.world_size"))
    cells = property(operator.attrgetter("loop.count"), doc="the cells run so far")
    ended_why = property(operator.attrgetter("call.ended_why"))
    log_dir = property(operator.attrgetter("call.log_dir"))
    record = property(operator.attrgetter("call.record"), doc="its MLflow run's RecordLink, once made")

    def __enter__(self) -> Session:
        if self.state == SessionStatus.NEW:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<air_magic session {self.id}: {self.state}, {self.world_size} rank(s), {self.cells} cell(s)>"

    def alive(self) -> bool:
        return self.call.alive()

    def start(self) -> Session:
        """Start the ranks, set up their process group, and make this the active session."""
        global _active, _last
        if self.state != SessionStatus.NEW:
            raise ConfigurationError(f"session {self.id} was already started ({self.state})")
        current = active()
        if current is not None:
            raise ConfigurationError(
                f"session {current.id} is running ({current.world_size} rank(s)): stop it first "
                "(%distributed session stop, or session.stop())"
            )
        start = self.call.launch()
        _last = self
        self.loop.follow_start(start)
        with _active_lock:
            _active = self
        return self

    def stop(self, wait_s: float = STOP_WAIT_S, quiet: bool = False) -> None:
        """End the session: each rank leaves its loop (its process group ends), then every process
        is gone. A cell running (on another thread) is interrupted first, as Ctrl-C would, and
        raises that the session was stopped. Safe to call twice."""
        call = self.call
        self.names.clear()  # the notebook's objects are its own again (and not kept alive here)
        self._deactivate()
        if call.state == SessionStatus.ENDED or not call.started():
            call.state = SessionStatus.ENDED
            return
        cell = call.interrupt_the_running_cell()
        if cell is not None:
            print(
                f"air_magic: session {self.id}: cell {cell.number} was running: its ranks get SIGINT, "
                "then the stop",
                file=sys.stderr,
                flush=True,
            )
        call.ask_to_stop()
        call.join(min(wait_s, SLOW_STOP_S))
        if cell is not None and call.running() and cell.still_in():
            # SIGINT did not end the cell there: its time to report it, then no more waiting.
            call.join(max(0.0, min(wait_s, cell_loop.RECOVER_S) - SLOW_STOP_S))
            if call.running():
                call.say_stuck_in(cell, cell_loop.RECOVER_S)
        elif call.running() and wait_s > SLOW_STOP_S:
            call.say_why_slow(wait_s)
            call.join(wait_s - SLOW_STOP_S)
        stopped = call.running()
        if stopped:
            call.stop_ranks()
        call.state = SessionStatus.ENDED
        if not quiet:
            how = f"stopped after {wait_s:g} s" if stopped else "every rank is gone"
            print(f"air_magic: session {self.id} stopped; {how}")

    def restart(self) -> Session:
        """Stop this session's ranks and start new ones with the same settings, in place: this
        object (a ``with`` block's, the one ``%%distributed`` cells run in) is the new session,
        with a new id and empty globals. Returns itself."""
        settings, name, backend = self.settings, self.name, self.call.given_backend
        self.stop(quiet=True)
        self._compose(settings, name, backend)
        return self.start()

    def status(self) -> str:
        """The session in words: its ranks, what each holds, the cells run, where its logs are."""
        call = self.call
        lines = [f"session {self.id}: {self.state}, {self.world_size} rank(s), {self.cells} cell(s) run"]
        if call.ended_why and call.state == SessionStatus.ENDED:
            lines.append(f"  ended: {call.ended_why}")
        # A rank whose own exception ended the session (a rank that died is "ended" below).
        raised = {f.rank: f for f in self.loop.failed if f.number == call.ended_in_cell and f.raised}
        for rank in range(self.world_size):
            pid = call.pids.get(rank)
            if rank in raised:  # its error ended the session: the stop that followed is not its end
                lines.append(f"  rank {rank}: pid {pid}, raised in {raised[rank].words}")
            elif rank in call.ended_ranks:
                lines.append(f"  rank {rank}: pid {pid}, ended ({call.ended_ranks[rank]})")
            else:
                lines.append(f"  rank {rank}: pid {pid}, {memory_words(call.memory.get(rank))}")
        if call.log_dir:
            lines.append(f"  logs: {call.log_dir}")
        if call.record is not None:
            lines.append(f"  {call.record.url or call.record.description}")
        return "\n".join(lines)

    # -- running code in it (calls/cell_loop.py) ---------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank of the session; every rank's value, in rank order."""
        bound = inspect.signature(fn).bind(*args, **kwargs)
        return self.run_call(getattr(fn, "__name__", "function"), fn, bound, kind="function").unwrap()

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
        self, name: str, func: Callable[..., Any], bound: inspect.BoundArguments, **how: Any
    ) -> RunResult:
        """One cell or function on every rank (``how``: ``CellLoop.run_call``'s keywords)."""
        return self.loop.run_call(name, func, bound, **how)

    # -- names between the notebook and the ranks (calls/held_names.py) ---------------------

    def held_by_ranks(self, name: str, value: Any) -> bool:
        return self.names.held_by_ranks(name, value)

    def note_held(self, names: dict[str, Any]) -> None:
        self.names.note(names)

    def forget(self, names: list[str]) -> None:
        self.names.forget(names)

    def _session_error(self, when: str) -> SessionEndedError:
        return self.call.error(when)

    def _deactivate(self) -> None:
        """No longer the session cells run in (its end was said, or it is stopping)."""
        global _active
        with _active_lock:
            if _active is self:
                _active = None


def session(**settings: Any) -> Session:
    """A persistent session with these launch settings (the decorator's keywords), not yet started.

    ``with air_magic.session(num_accelerators=2) as s:`` starts it, makes it the
    session ``%%distributed`` cells run in, and stops it at the block's end;
    ``s.run(fn, *args)`` and ``s.run_cell(source)`` run code in its ranks.
    """
    return Session(make_settings(**settings))
