"""Live per-rank tabs in a notebook: one ipywidgets tab per rank under a status header.

A consumer of launch events, like the text display; it never drives
processes. Rank output goes into a :class:`~air_magic.display.screen.RankScreen`
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
"""

from __future__ import annotations

import collections
import html
import sys
import threading
import time
from typing import Any

from air_magic import paths
from air_magic.display import record
from air_magic.display.screen import RankScreen
from air_magic.protocol.events import (
    Event,
    Outcome,
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

FLUSH_S = 0.25  # at most 4 browser updates a second per rank: live to the eye, cheap for the kernel
KEEP_LIVE = 20  # ended calls whose tabs stay live; older ones become their static record
_ended: collections.deque[WidgetDisplay] = collections.deque()
_ended_lock = threading.Lock()

GLYPHS = {
    RankState.STARTING: "○",
    RankState.RUNNING: "●",
    RankState.SUCCEEDED: "✓",
    RankState.FAILED: "✗",
    RankState.KILLED: "■",
}
_COLORS = {
    RankState.STARTING: "#888",
    RankState.RUNNING: "#1a73e8",
    RankState.SUCCEEDED: "#188038",
    RankState.FAILED: "#d93025",
    RankState.KILLED: "#b06000",
}


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
        self._record = record
        self._screens: list[RankScreen] = []
        self._states: list[RankState] = []
        self._reasons: list[str] = []
        self._started_at: list[float | None] = []
        self._ended_at: list[float | None] = []
        self._dirty: set[int] = set()
        self._last_flush = 0.0
        self._run: RunStarted | None = None
        self._outcome: str = Outcome.RUNNING  # or "starting" (tabs shown before the call starts)
        self._elapsed = 0.0
        self._t0 = time.monotonic()
        self._name = ""
        self._session: SessionState | None = None  # a persistent session's cell: what it holds
        self._handle: Any = None  # the display's handle (its id): the static record is updated through it

    def set_record(self, record: RecordLink | None) -> None:
        """The call's MLflow run, known once it exists (a background call shows its tabs before)."""
        self._record = record

    def show(self, world_size: int, name: str) -> None:
        """Put the tabs in the cell now, before the call starts (a background call: the cell that
        started it may end before its first event, and a frontend shows nothing sent to a cell
        after it ended; later changes are widget state, which reaches the tabs wherever they are)."""
        self._name = name
        self._outcome = "starting"
        self._make(world_size)

    # -- events -------------------------------------------------------------------------

    def handle(self, event: Event) -> None:
        if isinstance(event, SessionState):  # shown with the next update (or in the header made next)
            self._session = event
            return
        if isinstance(event, RunStarted):
            self._run = event
            self._outcome = Outcome.RUNNING
            if not self._screens or len(self._screens) != event.world_size:
                self._make(event.world_size)
            else:
                self._refresh_run()
        elif self._run is None:
            return
        elif isinstance(event, RankOutput):
            self._screens[event.rank].write(event.stream, event.text)
            self._dirty.add(event.rank)
            self._flush()
        elif isinstance(event, Tick):
            self._elapsed = event.elapsed
            self._flush()
        elif isinstance(event, RankStarted):
            self._states[event.rank] = RankState.RUNNING
            self._started_at[event.rank] = time.monotonic()
        elif isinstance(event, RankExited):
            self._states[event.rank] = event.state
            self._reasons[event.rank] = event.reason
            self._ended_at[event.rank] = time.monotonic()
            # Not forced: ranks that end together (a session's cell) make one update, not one each;
            # the next tick shows it (at most FLUSH_S later) and the run's end always does.
            self._flush()
        elif isinstance(event, RunFinished):
            self._outcome = event.outcome
            self._elapsed = event.elapsed
            if event.failed_rank is not None:
                self._tab.selected_index = event.failed_rank
            self._dirty.update(range(len(self._screens)))
            self._flush(force=True)
            if self._handle is not None:
                self._handle.update(self._bundle(), raw=True)
            _retire_the_oldest(self)

    # -- widgets ------------------------------------------------------------------------

    def _make(self, n: int) -> None:
        import ipywidgets as w
        from IPython.display import display

        self._screens = [RankScreen() for _ in range(n)]
        self._states = [RankState.STARTING] * n
        self._reasons = [""] * n
        self._started_at = [None] * n
        self._ended_at = [None] * n
        self._t0 = time.monotonic()
        # Few widgets, their layouts and style shared: each widget is a message to the browser and
        # about 1 ms of the kernel's time, which a persistent session's cell pays every time (SPEC §15).
        # Each rank's log and dropped lines are in the header's table, not in a widget of their own.
        self._header = w.HTML(value=self._header_html(), layout=_shared("layout"), style=_shared("style"))
        self._outputs = [w.Output(layout=_shared("output")) for _ in range(n)]
        self._tab = w.Tab(children=self._outputs, layout=_shared("layout"))
        self._titles = [self._title(r) for r in range(n)]
        self._tab.titles = tuple(self._titles)
        self._box = w.VBox([self._header, self._tab], layout=_shared("layout"))
        self._box.add_class("air-magic-run")
        self._last_flush = time.monotonic()  # what _make sent is current
        # The widget view, and beside it a static record for wherever widgets do not render
        # (display/record.py); replaced through the display id when the call ends.
        self._handle = display(self._bundle(), raw=True, display_id=True)

    def retire(self) -> None:
        """The view becomes its static record; the widgets are closed (shared layouts stay)."""
        if self._handle is not None:
            static = self._bundle()
            static.pop("application/vnd.jupyter.widget-view+json", None)
            self._handle.update(static, raw=True)
        for widget in (self._box, self._tab, self._header, *self._outputs):
            widget.close()

    def _bundle(self) -> dict[str, Any]:
        """The widget view with the static record as ``text/html`` and ``text/plain``."""
        # The widget view's reference, written here: ipywidgets' own _repr_mimebundle_ also builds a
        # repr of every widget for text/plain (about 1 ms), which the record below replaces anyway.
        bundle: dict[str, Any] = {
            "application/vnd.jupyter.widget-view+json": {
                "version_major": 2,
                "version_minor": 0,
                "model_id": self._box.model_id,
            }
        }
        now = record.Record(
            name=self._run.name if self._run is not None else self._name,
            world_size=len(self._states),
            mode=self._mode(),
            outcome=self._outcome,
            elapsed=self._elapsed,
            log_dir=self._run.log_dir if self._run is not None else None,
            link=self._record,
            rows=[
                record.RankRow(r, self._states[r], self._took(r), self._reasons[r], self._last_lines(r))
                for r in range(len(self._states))
            ],
            cpu_mode=self._run is not None and self._run.cpu_mode,
        )
        bundle["text/html"] = record.as_html(now)
        bundle["text/plain"] = record.as_text(now)
        return bundle

    def _last_lines(self, rank: int) -> list[str]:
        return [line for _, line in list(self._screens[rank].lines)[-record.LAST_LINES :]]

    def _took(self, rank: int) -> str:
        start, end = self._started_at[rank], self._ended_at[rank]
        return "" if start is None else f"{((end or time.monotonic()) - start):.1f} s"

    def _mode(self) -> str:
        run = self._run
        if run is None:
            return "the ranks are not started yet"
        return f"CPU mode, {run.backend}" if run.cpu_mode else f"{run.detected}, {run.backend}"

    def _refresh_run(self) -> None:
        """The run started: its log folder and mode go in the header."""
        self._header.value = self._header_html()

    def _flush(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_flush < FLUSH_S:
            return
        self._last_flush = now
        for rank in sorted(self._dirty):
            self._outputs[rank].outputs = self._screens[rank].stream_outputs()
        self._dirty.clear()
        titles = [self._title(r) for r in range(len(self._screens))]
        if titles != self._titles:
            self._titles = titles
            self._tab.titles = tuple(titles)
        header = self._header_html()
        if header != self._header.value:
            self._header.value = header

    def _title(self, rank: int) -> str:
        return f"rank {rank} {GLYPHS[self._states[rank]]}"

    def _log_html(self, rank: int) -> str:
        """The rank's full log (and how many earlier lines its tab no longer shows)."""
        if self._run is None:
            return ""
        dropped = self._screens[rank].dropped
        shown = f"{dropped} earlier lines not shown; " if dropped else ""
        path = html.escape(paths.rank_log(self._run.log_dir, rank))
        return f'<small style="color:#666">{shown}<code>{path}</code></small>'

    def _header_html(self) -> str:
        run = self._run
        n = len(self._states)
        mode, name = self._mode(), (run.name if run is not None else self._name)
        outcome = self._outcome
        rows = []
        for r, state in enumerate(self._states):
            took = self._took(r)
            rows.append(
                f'<tr><td>rank {r}</td><td style="color:{_COLORS[state]}">{GLYPHS[state]} {state.value}</td>'
                f"<td>{took}</td><td>{html.escape(self._reasons[r])}</td><td>{self._log_html(r)}</td></tr>"
            )
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
        return (
            f"<div><b>{html.escape(name)}</b> · {n} rank(s) · {html.escape(mode)} · "
            f"{html.escape(outcome)} · {self._elapsed:.1f} s{link}</div>{session}{cpu}"
            '<table style="font-size:90%"><tr><th align=left>rank</th><th align=left>state</th>'
            "<th align=left>elapsed</th><th align=left>exit</th><th align=left>full log</th></tr>"
            + "".join(rows)
            + "</table>"
        )


_SHARED: dict[str, Any] = {}


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


def _shared(kind: str) -> Any:
    """One layout (or style) model for every tab display of this kernel: 'layout', 'output' or 'style'.

    Made again if closed (``Widget.close_all()``)."""
    import ipywidgets as w

    found = _SHARED.get(kind)
    if found is None or getattr(found, "comm", None) is None:
        if kind == "output":
            found = w.Layout(max_height="30em", overflow="auto")
        elif kind == "style":
            try:  # ipywidgets 8; 7 styles an HTML widget with a DescriptionStyle
                from ipywidgets.widgets.widget_string import HTMLStyle as style_class
            except ImportError:
                style_class = w.DescriptionStyle
            found = style_class()
        else:
            found = w.Layout()
        _SHARED[kind] = found
    return found


def make_consumers(display: str, record: RecordLink | None = None) -> list[Any]:
    """The display consumers for a display mode: 'auto', 'tabs', 'text', 'rank0' or 'none'."""
    from air_magic.display.text import TextDisplay

    if display == "none":
        return []
    if display == "text":
        return [TextDisplay(record=record)]
    if display == "rank0":
        return [TextDisplay(ranks={0}, record=record)]
    if display == "tabs" or widgets_available():
        return [WidgetDisplay(record=record)]
    return [TextDisplay(record=record)]
