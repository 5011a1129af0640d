"""Background runs: a call that hands back a :class:`RunHandle` at once while its ranks run.

``fn.distributed_async(...)`` and ``%%distributed --background`` come here with a
call that ``calls/call.prepare_call`` has already checked and packed (a mistake
raised on the caller's thread, before any handle existed)::

    start_background(prepared)
      1. the display is built and shown now, on the caller's thread: the tabs sit in the
         cell that started the run (a frontend shows nothing sent to a cell after it
         ended; later changes are widget state, which reaches the tabs wherever they are)
      2. a daemon thread runs the call in a copy of the caller's context: ipykernel >= 7
         keeps "which cell is this output for" in context variables, so anything the
         call prints goes to the cell that started it, not to whichever cell runs now
      3. the handle: status, done(), result(timeout), cancel(), logs(rank), stacks();
         shown in a notebook as a live status line
    cancel_all()   at interpreter exit (a kernel's shutdown or restart, a script's end): every
                   background run stops as an interrupt would stop it, with one line on stderr,
                   its MLflow run ends KILLED, and no rank outlives the process. It runs when
                   the main thread ends, before Python's own exit steps (threading's exit
                   hooks), while imports still work: a run whose MLflow run is still being made
                   (importing MLflow registers exit hooks, refused once those run) gets it,
                   and ends it KILLED. calls/call.py's exit hook runs it again, for a process
                   that ends otherwise. ``air-magic run notebook.ipynb`` waits for them instead.

The thread is a daemon: the interpreter does not wait for it at exit (a non-daemon
thread would keep a kernel's shutdown waiting for the training to finish).
"""

from __future__ import annotations

import html
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from air_magic import paths
from air_magic.display.widgets import WidgetDisplay, rewrite_at_cell_ends, widgets_available
from air_magic.launch.request import RunResult
from air_magic.launch.settings import stop_grace_s
from air_magic.outcome.stacks import format_stacks
from air_magic.protocol.events import (
    Consumer,
    Event,
    Outcome,
    RankExited,
    RankStarted,
    RunFinished,
    RunStarted,
    Tick,
)
from air_magic.threads import start_in_context
from air_magic.user_warnings import warn_at_user_line

CANCEL_WAIT_S = 10.0  # cancel(): beyond the call's stop grace, the wait for the ranks' exits and the end
AT_EXIT_WAIT_S = 30.0  # at exit, for all background runs together (both exit hooks: one deadline);
# a run still making its MLflow run (a script that ended at once) needs it, one that runs needs the grace
AT_EXIT_GRACE_S = 1.0  # at exit the ranks get SIGTERM and this long, not SIGINT and the call's
# stop_grace: the process is going, and a kernel's manager kills a kernel that takes more than 5 s
# to shut down (its MLflow runs would stay RUNNING): the ranks must be gone well before.
_STATUS_EVERY_S = 0.5  # the live status line is redrawn at most this often

_active: set[RunHandle] = set()
_active_lock = threading.Lock()


class StackDump(dict[int, str]):
    """Each rank's thread stacks (rank -> text as the tool wrote it); printed, the user's frames."""

    def __str__(self) -> str:
        return format_stacks(self) if self else "(no rank is running)"

    def __repr__(self) -> str:
        return str(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))


class RunHandle:
    """A call running in the background. ``status``: 'starting', 'running', 'succeeded',
    'failed', 'timeout' or 'cancelled'."""

    def __init__(
        self,
        name: str,
        world_size: int,
        *,
        stop: Callable[..., None],  # stop(grace_s=None): a shorter grace than the call's, if given
        stacks: Callable[[], dict[int, str]],
        on_result: Callable[[RunResult], Any] | None = None,
        stop_grace: float = 0.0,
        read_log: Callable[[int], str] | None = None,  # a rank's log, where it is not on this machine
        began: float | None = None,  # when the run began (time.monotonic()), if before this handle
        # Why a stopped run has not ended though its ranks have (None: it has not): a detached run's
        # supervisor waiting for room on a full disk to write the run's end (calls/detached.py).
        why_not_ended: Callable[[], str | None] | None = None,
    ) -> None:
        self.name = name
        self._why_not_ended = why_not_ended
        self._read_log = read_log
        self._stop_grace = stop_grace  # the ranks' time to end after a stop: cancel() waits it out
        self._stop_said = False  # cancel_all() said it stops this run
        self.world_size = world_size
        self._stop = stop  # how the run is stopped: its backend's stop(), or a signal to a supervisor
        self._take_stacks = stacks
        self._on_result = on_result
        self._finished = threading.Event()
        self._result: RunResult | None = None
        self._error: BaseException | None = None  # the call itself failed (not a rank)
        self._value: Any = None
        self._value_taken = False
        self._status = "starting"
        self._started = time.monotonic()
        # What the elapsed time counts from: a detached run followed from here began before its handle.
        self._began = min(began, self._started) if began is not None else self._started
        self._elapsed: float | None = None
        self.log_dir: str | None = None
        self.call_id: str | None = None  # the call's id (its log folder's name), once it started
        self.rank_states: dict[int, str] = {}
        self.rank_pids: dict[int, int] = {}  # rank -> pid, as each rank starts
        self.detached_id: str | None = None  # a detached run's id (calls/detached.py), for attach()
        self.kind = "function"  # what ran: 'function', 'cell', 'script' or 'module'
        self._status_html: Any = None  # the live status line, once displayed in a notebook
        self._status_shown: list[Any] = []  # its display handles (ids): rewritten at later cells' ends
        self._last_drawn = 0.0
        self._thread: threading.Thread | None = None

    # -- what the user asks ---------------------------------------------------------------

    @property
    def status(self) -> str:
        return self._status

    @property
    def run_id(self) -> str | None:
        """The former name of :attr:`call_id`."""
        return self.call_id

    @property
    def started(self) -> float:
        """When this handle began (``time.monotonic()``): the order of runs in this process."""
        return self._started

    def done(self) -> bool:
        """True once the call has ended (every rank gone), however it ended."""
        return self._finished.is_set()

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the end (at most ``timeout`` seconds); return what the call returns, or raise
        its error (the failing rank's own exception, as a foreground call would)."""
        if not self._finished.wait(timeout):
            raise TimeoutError(
                f"{self.name} is still running after {timeout:g} s (status: {self._status}); "
                "result() again waits longer, cancel() stops it"
            )
        if self._error is not None:
            raise self._error
        assert self._result is not None
        if self._on_result is None:
            return self._result.unwrap()
        if not self._value_taken:  # once: a %%distributed cell brings its names back here
            self._value = self._on_result(self._result)
            self._value_taken = True
        return self._value

    def run_result(self) -> RunResult:
        """The ended call as a :class:`RunResult` (its outcome, values or error)."""
        self._finished.wait()
        if self._error is not None:
            return RunResult(self.call_id or "", self.log_dir or "", Outcome.FAILED, error=self._error)
        assert self._result is not None
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error :meth:`result` would raise (None on success), after waiting like it."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"{self.name} is still running after {timeout:g} s")
        if self._error is not None:
            return self._error
        assert self._result is not None
        return self._result.error

    def cancel(self, wait: bool = True) -> bool:
        """Stop every rank (as Ctrl-C stops a foreground call); True once the call has ended.

        The ranks get SIGINT (``KeyboardInterrupt``) and the call's ``stop_grace`` to end, then
        SIGKILL. With ``wait`` (default) returns when every rank is gone: at once for ranks that
        take the interrupt, at most the grace (and a few seconds) for one that does not."""
        if not self._finished.is_set():
            self._stop()
        if wait:
            deadline = time.monotonic() + self._stop_grace + CANCEL_WAIT_S
            while not self._finished.wait(min(0.5, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline or self.why_not_ended() is not None:
                    break
            why = self.why_not_ended()
            if why is not None:
                warn_at_user_line(f"air_magic: {self.name} is stopped: {why}", RuntimeWarning)
        return self._finished.is_set()

    def why_not_ended(self) -> str | None:
        """Why this run, stopped, has not ended though every rank is gone (None: it has ended, or
        a rank still runs): say, a detached run's supervisor waits for room on a full disk to
        write the run's end. ``cancel()`` returns False then, at once."""
        if self._finished.is_set() or self._why_not_ended is None:
            return None
        return self._why_not_ended()

    def logs(self, rank: int = 0, lines: int | None = None) -> str:
        """What rank ``rank`` has printed so far (its log file; the last ``lines`` lines if given)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in {self.name} (ranks 0 to {self.world_size - 1})")
        text = self._read_log(rank) if self._read_log is not None else read_rank_log(self.log_dir, rank)
        if lines is not None:
            text = "".join(text.splitlines(keepends=True)[-lines:])
        return text

    def stacks(self) -> StackDump:
        """Every thread's Python stack in every running rank (py-spy, else a signal; see
        ``outcome/stacks.py``). Printed, it shows the user's frames; the full dumps are also
        appended to ``stacks.txt`` in the call's log folder."""
        return StackDump(self._take_stacks())

    # -- how it shows ---------------------------------------------------------------------

    def _took(self) -> float:
        """Seconds the run has taken: since it began while it runs, its whole time once ended."""
        return self._elapsed if self._elapsed is not None else time.monotonic() - self._began

    def __repr__(self) -> str:
        took = self._took()
        where = f"; logs: {self.log_dir}" if self.log_dir else ""
        return f"<RunHandle {self.name}: {self._status}, {self.world_size} rank(s), {took:.1f} s{where}>"

    def _ipython_display_(self) -> None:
        from IPython.display import display

        if not widgets_available():
            print(repr(self))
            return
        import ipywidgets as w

        if self._status_html is None:
            self._status_html = w.HTML(value=self._status_line())
        # The line as text and HTML beside the widget (ipywidgets' own text is "HTML(value=...)"),
        # rewritten at the end of later cells until the run has ended, as its tabs' record is
        # (display/widgets.py): a notebook executed by nbclient keeps only what comes during a cell.
        shown = display(self._status_bundle(), raw=True, display_id=True)
        if shown is not None:
            if not self._status_shown:
                rewrite_at_cell_ends(self._rewrite_status)
            self._status_shown.append(shown)

    def _status_bundle(self) -> dict[str, Any]:
        line = self._status_line()
        took = self._took()
        ranks = ", ".join(f"{r}: {s}" for r, s in sorted(self.rank_states.items()))
        return {
            "application/vnd.jupyter.widget-view+json": {
                "version_major": 2,
                "version_minor": 0,
                "model_id": self._status_html.model_id,
            },
            "text/html": line,
            "text/plain": f"{self.name} in the background: {self._status} · {took:.1f} s"
            + (f" · {ranks}" if ranks else ""),
        }

    def _rewrite_status(self) -> bool:
        """At the end of a later cell, in it: the status line again. True once the run has ended."""
        ended = self._finished.is_set()
        widget = self._status_html
        widget.value = self._status_line()
        widget.send_state("value")
        bundle = self._status_bundle()
        for shown in self._status_shown:
            shown.update(bundle, raw=True)
        return ended

    def _status_line(self) -> str:
        took = self._took()
        ranks = ", ".join(f"{r}: {s}" for r, s in sorted(self.rank_states.items()))
        return (
            f"<code>{html.escape(self.name)}</code> in the background: <b>{html.escape(self._status)}</b>"
            f" · {took:.1f} s" + (f" · {html.escape(ranks)}" if ranks else "")
        )

    def _redraw(self, force: bool = False) -> None:
        widget = self._status_html
        now = time.monotonic()
        if widget is None or (not force and now - self._last_drawn < _STATUS_EVERY_S):
            return
        self._last_drawn = now
        widget.value = self._status_line()

    # -- the call's events (the handle is one of its consumers) ------------------------------

    def handle(self, event: Event) -> None:
        if isinstance(event, RunStarted):
            self.log_dir, self.call_id = event.log_dir, event.call_id
            self._status = Outcome.RUNNING
            self._redraw(force=True)
        elif isinstance(event, RankStarted):
            self.rank_pids[event.rank] = event.pid
            self.rank_states[event.rank] = "running"
        elif isinstance(event, RankExited):
            self.rank_states[event.rank] = event.state.value
            self._redraw()
        elif isinstance(event, Tick):
            self._redraw()
        elif isinstance(event, RunFinished):
            self._elapsed = event.elapsed

    # -- the end ----------------------------------------------------------------------------

    def _finish(self, result: RunResult | None, error: BaseException | None = None) -> None:
        """The call has ended with ``result`` (or, when the call itself broke, ``error``)."""
        self._result, self._error = result, error
        outcome = result.outcome if result is not None else Outcome.FAILED
        self._status = Outcome.CANCELLED if outcome == Outcome.INTERRUPTED else outcome
        if self._elapsed is None:
            self._elapsed = time.monotonic() - self._began
        self._finished.set()
        self._redraw(force=True)


def start_background(
    prepared: Any,
    *,
    on_result: Callable[[RunResult], Any] | None = None,
    consumers: Sequence[Consumer] = (),
) -> RunHandle:
    """Start a prepared call (``calls/call.prepare_call``) on a thread; its handle, at once."""
    backend = prepared.backend
    handle = RunHandle(
        prepared.name,
        prepared.plan.world_size,
        stop=backend.stop,
        stacks=backend.stacks,
        on_result=on_result,
        stop_grace=stop_grace_s(prepared.settings.stop_grace),
    )
    displays = show_displays(prepared.displays(), prepared.plan.world_size, prepared.name)

    def run() -> None:
        result, error = None, None
        try:
            result = prepared.run(displays, [*consumers, handle])
        except BaseException as exc:  # noqa: BLE001 - handed to result(); nothing is lost
            error = exc
        finally:
            with _active_lock:
                _active.discard(handle)
        handle._finish(result, error)

    with _active_lock:
        _active.add(handle)
    try:
        _stop_when_the_main_thread_ends()
        start_in_context(run, f"air_magic-background-{prepared.name}")
    except BaseException:
        with _active_lock:
            _active.discard(handle)
        prepared.abandon()
        raise
    return handle


def show_displays(displays: list[Consumer], world_size: int, name: str) -> list[Consumer]:
    """Put each display's view in the cell now, on the caller's thread (see the module's docstring)."""
    for display in displays:
        if isinstance(display, WidgetDisplay):
            display.show(world_size, name)
    return displays


_exit_hook_set = False


def _stop_when_the_main_thread_ends() -> None:
    """Register :func:`cancel_all` among threading's exit hooks (once): they run as soon as the main
    thread ends, before ``atexit``'s, while the runs' threads can still import and end their MLflow
    runs (concurrent.futures stops its workers the same way)."""
    global _exit_hook_set
    if _exit_hook_set:
        return
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - every Python we support has it; atexit's hook remains
        return
    try:
        register(cancel_all)
    except RuntimeError:  # the process is already exiting: atexit's hook (calls/call.py) remains
        return
    _exit_hook_set = True


def running() -> list[RunHandle]:
    """The background runs of this process that have not ended yet, oldest first."""
    with _active_lock:
        return sorted(_active, key=lambda h: h.started)


_exit_deadline: float | None = None


def read_rank_log(log_dir: str | None, rank: int) -> str:
    """Rank ``rank``'s log in the call folder ``log_dir`` on this machine ('' while it has none)."""
    if log_dir is None:
        return ""
    try:
        with open(paths.rank_log(log_dir, rank), errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def cancel_all(wait_s: float = AT_EXIT_WAIT_S) -> None:
    """Stop every background run (interpreter exit: a kernel shut down or restarted with runs going,
    a script that ended without waiting for its runs), one line each on stderr. Called twice at
    exit (threading's hook, then atexit's): one deadline for both."""
    global _exit_deadline
    if _exit_deadline is None:
        _exit_deadline = time.monotonic() + wait_s
    end = _exit_deadline
    handles = running()
    for handle in handles:
        if handle._stop_said:  # threading's exit hook, then atexit's: one line a run
            continue
        handle._stop_said = True
        where = f"; logs: {handle.log_dir}" if handle.log_dir else ""
        print(
            f"air_magic: this process is exiting: background run {handle.name} ({handle._status}) is "
            f"stopped{where}. Call its handle's result() before the end to wait for it.",
            file=sys.stderr,
            flush=True,
        )
        handle._stop(AT_EXIT_GRACE_S, signal.SIGTERM)
    for handle in handles:
        handle._finished.wait(max(0.0, end - time.monotonic()))
