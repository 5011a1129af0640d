"""Live rank output in a notebook: a tab per rank, or past 16 ranks a summary with tabs for a few.

A consumer of launch events, like the text display; it never drives
processes. Each rank's state is kept in a :class:`~air_magic.display.rank_board.RankBoard`
and shown by one of two views: ``tab_view.py`` (a state table and a tab per rank) or,
past ``MANY_RANKS`` ranks, ``summary_view.py`` (counts, a grid, tabs for the ranks
worth a look, any rank on demand). Rank output goes into a :class:`~air_magic.display.screen.RankScreen`
(carriage returns redraw, capped tail) and reaches the browser at most every
:data:`FLUSH_S` seconds per rank, as one replacement of the tab's outputs:
appending line by line to an ``Output`` widget grows quadratically (2 000
appends took 8 s when measured), one replacement of a capped tail does not.
The kernel's messages to the browser are therefore bounded by time, not by
how much the ranks print.

The widgets of ended calls are bounded too: the newest :data:`KEEP_LIVE` ended
calls keep their live tabs; an older one's view is replaced, through its display
id, by its static record (each rank's state, last lines and log, the MLflow link)
and its widgets are closed, so a session of hundreds of cells does not pile up
widget models in the kernel, the browser and the saved notebook.

A call that outlives its cell (a background run, a detached run followed here: :meth:`WidgetDisplay.show`)
goes on after its cell ended. Its updates then carry that cell's parent header, and a frontend
that keeps only what comes while a cell runs drops them: nbclient (so ``jupyter nbconvert
--execute`` and papermill) saved its record as "starting" and its tabs as they were when the cell
ended. So at the end of every later cell (IPython's ``post_run_cell``, in that cell) the record is
sent again through its display id, and the widgets' state with it, until the call has ended:
nbclient applies a display update to the earlier output that has its id, and keeps widget state
from any cell. JupyterLab applies neither to a cell whose execution is over (its tabs are live
through their comms anyway), so there it changes nothing. While the call goes on the record is
rewritten when its states changed or every :data:`REWRITE_EVERY_S`, and it says when it was
written: a notebook that ends before the run does is saved "still running at 14:03:05".
"""

from __future__ import annotations

import collections
import html
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from air_magic.display import record
from air_magic.display.rank_board import RankBoard, counts_words
from air_magic.display.summary_view import SummaryView
from air_magic.display.tab_view import TabView
from air_magic.protocol.events import (
    Event,
    Outcome,
    RankExited,
    RankOutput,
    RankStarted,
    RecordLink,
    RunFinished,
    RunStarted,
    SessionState,
    Tick,
)

FLUSH_S = 0.25  # at most 4 browser updates a second per rank: live to the eye, cheap for the kernel
KEEP_LIVE = 20  # ended calls whose tabs stay live; older ones become their static record
REWRITE_EVERY_S = 5.0  # a call going on after its cell: its record rewritten at most this often
# at a later cell's end (sooner when a rank's state changed); its end always
_ended: collections.deque[WidgetDisplay] = collections.deque()
_ended_lock = threading.Lock()


def widgets_available() -> bool:
    """True inside a Jupyter kernel with ipywidgets installed, in a frontend that renders our tabs.

    Colab is known not to: its built-in widget manager is ipywidgets 7's, and under the
    ipywidgets 8 manager ``Tab`` does not render (NOTES.md, "Frontends"); text there. Other
    frontends cannot be told apart from the kernel; where the view does not render, the
    record beside it does (display/record.py).
    """
    if "google.colab" in sys.modules:
        return False
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or getattr(shell, "kernel", None) is None:
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


class WidgetDisplay:
    def __init__(self, record: RecordLink | None = None) -> None:
        self._lock = threading.Lock()  # events (the call's thread) against a later cell's rewrite
        self._record = record
        self._board = RankBoard.of(0)
        self._view: TabView | SummaryView | None = None
        self._dirty: set[int] = set()
        self._last_flush = 0.0
        self._run: RunStarted | None = None
        self._outcome: str = Outcome.RUNNING  # or "starting" (tabs shown before the call starts)
        self._elapsed = 0.0
        self._name = ""
        self._session: SessionState | None = None  # a persistent session's cell: what it holds
        self._root_cause: int | None = None  # the rank that failed first, once the call ended
        self._handle: Any = None  # the display's handle (its id): the static record is updated through it
        self._outlives_cell = False  # shown before its call started: the call goes on after its cell
        self._ended = False  # RunFinished came
        self._retired = False
        self._rewritten: tuple[Any, ...] = ()  # what the last rewrite at a cell's end said
        self._rewritten_at = 0.0

    def set_record(self, record: RecordLink | None) -> None:
        """The call's MLflow run, known once it exists (a background call shows its tabs before)."""
        self._record = record

    def show(self, world_size: int, name: str) -> None:
        """Put the tabs in the cell now, before the call starts (a background call: the cell that
        started it may end before its first event, and a frontend shows nothing sent to a cell
        after it ended; later changes are widget state, which reaches the tabs wherever they are)."""
        self._name = name
        self._outcome = "starting"
        self._outlives_cell = True
        self._make(world_size)
        self._rewritten, self._rewritten_at = self._said(), time.monotonic()
        rewrite_at_cell_ends(self._rewrite)

    def _said(self) -> tuple[Any, ...]:
        """What the record says that a rewrite must not wait for: the call's and the ranks' states."""
        return (self._outcome, tuple(self._board.states), self._run is not None, self._record)

    def _rewrite(self) -> bool:
        """At the end of a later cell, in it: the record and the widgets' state sent again (see the
        module's docstring). True once the call's end is sent: nothing more to rewrite."""
        with self._lock:
            ended, said, now = self._ended, self._said(), time.monotonic()
            if not ended and said == self._rewritten and now - self._rewritten_at < REWRITE_EVERY_S:
                return False
            self._rewritten, self._rewritten_at = said, now
            if self._view is None or self._handle is None:
                return ended
            bundle = self._bundle()
            if self._retired:
                bundle.pop("application/vnd.jupyter.widget-view+json", None)
            else:
                self._flush(force=True)
                for widget in self._view.widgets():
                    # Not an Output's msg_id: nbclient's stand-in for an Output widget fails on an
                    # empty one it was not told before (nbclient 0.11, output_widget.set_state).
                    widget.send_state([key for key in widget.keys if key != "msg_id"])
        self._handle.update(bundle, raw=True)
        return ended

    # -- events -------------------------------------------------------------------------

    def handle(self, event: Event) -> None:
        with self._lock:
            self._handle_event(event)

    def _handle_event(self, event: Event) -> None:
        if isinstance(event, RecordLink):  # before the ranks start: the header shows it
            self.set_record(event)
            return
        if isinstance(event, SessionState):  # shown with the next update (or in the header made next)
            self._session = event
            return
        if isinstance(event, RunStarted):
            self._run = event
            self._outcome = Outcome.RUNNING
            if self._view is None or len(self._board) != event.world_size:
                self._make(event.world_size)
            else:
                self._board.nodes = event.node_of()
                if isinstance(self._view, SummaryView):
                    self._view.nodes_known()
                self._flush(force=True)  # its log folder and mode, in the header
        elif self._run is None:
            return
        elif isinstance(event, RankOutput):
            self._board.output(event.rank, event.stream, event.text)
            self._dirty.add(event.rank)
            self._flush()
        elif isinstance(event, Tick):
            self._elapsed = event.elapsed
            self._flush()
        elif isinstance(event, RankStarted):
            self._board.started(event.rank)
        elif isinstance(event, RankExited):
            self._board.exited(event.rank, event.state, event.reason)
            # Not forced: ranks that end together (a session's cell) make one update, not one each;
            # the next tick shows it (at most FLUSH_S later) and the run's end always does.
            self._flush()
        elif isinstance(event, RunFinished):
            self._finished(event)

    def _finished(self, event: RunFinished) -> None:
        self._outcome = event.outcome
        self._elapsed = event.elapsed
        self._root_cause = event.failed_rank
        self._ended = True
        view = self._view
        if isinstance(view, SummaryView):
            view.root_cause = event.failed_rank
        self._dirty.update(range(len(self._board)))
        self._flush(force=True)
        # The root cause's output first. Otherwise the tabs stay where the user left them: rank 0's
        # unless a tab was clicked, or a rank opened from the list.
        if view is not None and event.failed_rank is not None:
            view.select(event.failed_rank)
        if self._handle is not None:
            self._handle.update(self._bundle(), raw=True)
        _retire_the_oldest(self)

    # -- widgets ------------------------------------------------------------------------

    def _make(self, n: int) -> None:
        from IPython.display import display

        nodes = self._run.node_of() if self._run is not None else None
        self._board = RankBoard.of(n, nodes)
        view_class = SummaryView if self._board.many else TabView
        self._view = view_class(self._board, self._top_html(), self._log_dir())
        self._last_flush = time.monotonic()  # what _make sent is current
        # The widget view, and beside it a static record for wherever widgets do not render
        # (display/record.py); replaced through the display id when the call ends.
        self._handle = display(self._bundle(), raw=True, display_id=True)

    def retire(self) -> None:
        """The view becomes its static record; the widgets are closed (shared layouts stay)."""
        self._retired = True
        if self._handle is not None:
            static = self._bundle()
            static.pop("application/vnd.jupyter.widget-view+json", None)
            self._handle.update(static, raw=True)
        if self._view is not None:
            for widget in self._view.widgets():
                widget.close()

    def _bundle(self) -> dict[str, Any]:
        """The widget view with the static record as ``text/html`` and ``text/plain``."""
        # The widget view's reference, written here: ipywidgets' own _repr_mimebundle_ also builds a
        # repr of every widget for text/plain (about 1 ms), which the record below replaces anyway.
        assert self._view is not None
        bundle: dict[str, Any] = {
            "application/vnd.jupyter.widget-view+json": {
                "version_major": 2,
                "version_minor": 0,
                "model_id": self._view.box.model_id,
            }
        }
        board = self._board
        now = record.Record(
            name=self._run.name if self._run is not None else self._name,
            world_size=len(board),
            mode=self._mode(),
            outcome=self._outcome,
            elapsed=self._elapsed,
            log_dir=self._log_dir(),
            link=self._record,
            rows=[
                record.RankRow(r, board.states[r], board.took(r), board.reasons[r], self._last_lines(r))
                for r in record.shown_ranks(board.states, self._root_cause)
            ],
            cpu_mode=self._run is not None and self._run.cpu_mode,
            counts=counts_words(board.states),
            nodes=len(set(board.nodes)),
            note=self._note(),
        )
        bundle["text/html"] = record.as_html(now)
        bundle["text/plain"] = record.as_text(now)
        return bundle

    def _note(self) -> str:
        """For a record written before its call ended, in a cell other than the call's own."""
        if not self._outlives_cell or self._ended:
            return ""
        return (
            f"still {self._outcome} at {time.strftime('%H:%M:%S')}, when this record was written. A cell "
            "run after the run's end rewrites it; a notebook whose last cell does not wait for it (its "
            "handle's result()) is saved before its end."
        )

    def _last_lines(self, rank: int) -> list[str]:
        return [line for _, line in list(self._board.screens[rank].lines)[-record.LAST_LINES :]]

    def _log_dir(self) -> str | None:
        return self._run.log_dir if self._run is not None else None

    def _mode(self) -> str:
        run = self._run
        if run is None:
            return "the ranks are not started yet"
        return f"CPU mode, {run.backend}" if run.cpu_mode else f"{run.detected}, {run.backend}"

    def _flush(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._view is None or (not force and now - self._last_flush < FLUSH_S):
            return
        self._last_flush = now
        self._view.refresh(self._dirty, self._top_html(), self._log_dir(), force=force)
        self._dirty.clear()

    def _top_html(self) -> str:
        """The call in one line (name, ranks, mode, outcome, time, the MLflow link), what a
        session holds, and the CPU mode's note."""
        run = self._run
        n = len(self._board)
        mode, name = self._mode(), (run.name if run is not None else self._name)
        tracked = self._record
        if tracked is not None and tracked.url:
            link = f' · <a href="{html.escape(tracked.url)}" target="_blank">MLflow run</a>'
        elif tracked is not None:
            title, short = html.escape(tracked.description), html.escape(tracked.run_id)
            link = f' · <span title="{title}">MLflow run {short}</span>'
        else:
            link = ""
        cpu = ""
        if run is not None and run.cpu_mode:
            cpu = (
                '<div style="color:#b06000">CPU mode: no NVIDIA GPU is visible, so every rank runs on the '
                "CPU with gloo. Code that needs CUDA fails here: air_magic.init_process_group() picks "
                "gloo and the CPU here, NCCL and the rank's GPU on a GPU machine.</div>"
            )
        session = ""
        if self._session is not None:
            session = f'<div style="color:#444">{html.escape(self._session.describe())}</div>'
        # line-height: an HTML widget's own (28 px, for one line beside a control) spreads a block.
        return (
            f'<div style="line-height:1.4"><div><b>{html.escape(name)}</b> · {n} rank(s) · '
            f"{html.escape(mode)} · {html.escape(self._outcome)} · {self._elapsed:.1f} s{link}</div>"
            f"{session}{cpu}</div>"
        )


_rewrites: list[Callable[[], bool]] = []  # what a cell's end rewrites (rewrite_at_cell_ends)
_rewrites_lock = threading.Lock()
_hooked: Any = None  # the shell whose post_run_cell runs them


def rewrite_at_cell_ends(rewrite: Callable[[], bool]) -> None:
    """Call ``rewrite`` at the end of every cell from now on, in that cell (IPython's
    ``post_run_cell``), until it returns True: a display that outlives its cell sends its state
    again there (see the module's docstring). Only in a kernel: elsewhere no frontend keeps it."""
    global _hooked
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or getattr(shell, "kernel", None) is None:
        return
    with _rewrites_lock:
        _rewrites.append(rewrite)
        if _hooked is not shell:
            shell.events.register("post_run_cell", _rewrite_at_cell_end)
            _hooked = shell


def _rewrite_at_cell_end(result: Any = None) -> None:
    with _rewrites_lock:
        pending = list(_rewrites)
    done = []
    for rewrite in pending:
        try:
            if rewrite():
                done.append(rewrite)
        except Exception:  # noqa: BLE001 - a frontend gone away, a widget closed: nothing to rewrite
            done.append(rewrite)
    with _rewrites_lock:
        for rewrite in done:
            _rewrites.remove(rewrite)


def _retire_the_oldest(display: WidgetDisplay) -> None:
    """``display`` has ended: it joins the live ones; beyond KEEP_LIVE the oldest is retired."""
    with _ended_lock:
        _ended.append(display)
        old = [_ended.popleft() for _ in range(max(0, len(_ended) - KEEP_LIVE))]
    for retired in old:
        try:
            retired.retire()
        except Exception:  # noqa: BLE001 - a frontend gone away: nothing to update
            pass


def make_consumers(display: str) -> list[Any]:
    """The display consumers for a display mode: 'auto', 'tabs', 'text', 'rank0' or 'none' (the
    call's MLflow run reaches them as its RecordLink event)."""
    from air_magic.display.text import TextDisplay

    if display == "none":
        return []
    if display == "text":
        return [TextDisplay()]
    if display == "rank0":
        return [TextDisplay(ranks={0})]
    if display == "tabs" or widgets_available():
        return [WidgetDisplay()]
    return [TextDisplay()]
