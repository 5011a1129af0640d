"""The widget view for many ranks (more than ``MANY_RANKS``): counts, a grid, the ranks worth a look.

A tab per rank is neither readable nor cheap at 64 ranks, let alone 1,000. This
view shows instead:

- the counts by state and a grid of every rank's glyph coloured by its state,
  node by node (``many_ranks.py``), refreshed at most every :data:`SLOW_S`;
- :data:`SLOTS` tabs of live output: rank 0 and, as they appear, the ranks worth a
  look (the root cause, then failed, then stopped ranks, then running ranks silent
  for long). A rank takes the tab of a rank less worth a look, never rank 0's or
  the opened rank's; the tabs switch in the browser, so this works while the
  kernel runs the cell;
- "open any rank": a filter (``737``, ``700-710``, ``node 3``, ``failed``) and the
  matching ranks (their labels refreshed with the grid; which ranks, and in which
  order, only when the filter or the order changes); the one picked takes a tab.
  The kernel answers it when it is free: at once for a background call and after
  the call, at the cell's end for a foreground one (a busy kernel reads no message
  from the page: docs/architecture.md, "The view of many ranks").

What reaches the browser is bounded whatever the rank count: at most SLOTS tabs'
outputs every ``FLUSH_S`` (each the :data:`TAB_LINES` lines a rank's screen keeps:
``rank_board.py``), and the grid and the list (tens of kilobytes at most for 1,000
ranks) every SLOW_S.

A background call's events come on its own thread while a pick in the list comes
on the kernel's: one lock keeps the tabs' ranks, titles and list consistent.
"""

from __future__ import annotations

import html
import threading
import time
from typing import Any

from air_magic.display import many_ranks, widget_parts
from air_magic.display.rank_board import MANY_RANKS_LINES, RankBoard, tab_title

SLOTS = 8  # tabs of live output: rank 0, the ranks worth a look, the rank opened last
SLOW_S = 1.0  # the counts, the grid, the list and which ranks the tabs hold change at most this often
TAB_LINES = MANY_RANKS_LINES  # the end of a rank's output in its tab: fits without scrolling

_HELP = (
    '<div style="line-height:1.4"><small style="color:#666">open any rank: a rank (737), a range '
    "(700-710), a node (node 3) or a state (failed), commas between; the rank picked takes a tab. "
    "A call running in the foreground answers when its cell ends, a background one at once.</small></div>"
)


class SummaryView:
    def __init__(self, board: RankBoard, top_html: str, log_dir: str | None) -> None:
        import ipywidgets as w

        self.board = board
        self.log_dir = log_dir
        self.root_cause: int | None = None
        self.slots = first_slots(board)
        self.opened: int | None = None  # the rank picked in the list: its tab is not given to another
        self._last_slow = 0.0
        self._listing = False  # True while the list's options are replaced (not a pick)
        self._lock = threading.RLock()

        self.header = w.HTML(value=top_html, **widget_parts.html_kwargs())
        self.grid = w.HTML(value=self._grid_html(), **widget_parts.html_kwargs())
        self.outputs = [w.Output(layout=widget_parts.shared("output")) for _ in self.slots]
        self.tab = w.Tab(children=self.outputs, layout=widget_parts.shared("layout"))
        self.titles = [tab_title(self.board, r) for r in self.slots]
        self.tab.titles = tuple(self.titles)
        self.filter = w.Text(
            placeholder="737, 700-710, node 3, failed",
            description="open rank",
            layout=widget_parts.shared("layout"),
        )
        self.order = w.Dropdown(
            options=many_ranks.ORDERS,
            value=many_ranks.PROBLEMS_FIRST,
            description="order",
            layout=widget_parts.shared("layout"),
        )
        # value=None: nothing chosen, so a click on the first entry is a change too.
        self.pick = w.Select(options=self._options(), value=None, rows=4, layout=widget_parts.shared("wide"))
        self.help = w.HTML(value=_HELP, **widget_parts.html_kwargs())
        self.filter.observe(self._relist, names="value")
        self.order.observe(self._relist, names="value")
        self.pick.observe(self._picked, names="value")
        self.controls = w.HBox([self.filter, self.order], layout=widget_parts.shared("layout"))
        self.box = w.VBox(
            [self.header, self.grid, self.tab, self.controls, self.pick, self.help],
            layout=widget_parts.shared("layout"),
        )
        self.box.add_class("air-magic-run")
        self.box.add_class("air-magic-many-ranks")

    def widgets(self) -> list[Any]:
        """Every model this view made (the controls' own styles too), to close when it retires."""
        controls = [self.filter, self.order, self.pick]
        return [
            self.box,
            self.header,
            self.grid,
            self.tab,
            *self.outputs,
            *controls,
            *(c.style for c in controls),
            self.help,
            self.controls,
        ]

    def nodes_known(self) -> None:
        """The call started and said its nodes (tabs shown before it started): tabs by node."""
        with self._lock:
            if self.opened is None:
                self.slots = first_slots(self.board)

    # -- refresh ------------------------------------------------------------------------

    def refresh(self, dirty: set[int], top_html: str, log_dir: str | None, force: bool = False) -> None:
        with self._lock:
            self.log_dir = log_dir
            if top_html != self.header.value:
                self.header.value = top_html
            now = time.monotonic()
            moved: set[int] = set()
            if force or now - self._last_slow >= SLOW_S:
                self._last_slow = now
                moved = self._reassign(now)
                grid = self._grid_html()
                if grid != self.grid.value:
                    self.grid.value = grid
                self._retitle()
                self._relabel()
            for slot, rank in enumerate(self.slots):
                if rank in dirty or slot in moved:
                    self.outputs[slot].outputs = self.board.screens[rank].stream_outputs(TAB_LINES)

    def select(self, rank: int) -> None:
        """Show ``rank``'s tab. If no tab holds it, it takes the tab of the rank least worth a look
        (never rank 0's, nor the root cause's while another will do)."""
        with self._lock:
            if rank not in self.slots:
                now = time.monotonic()
                candidates = [s for s in range(1, len(self.slots)) if self.slots[s] != self.root_cause]
                candidates = candidates or list(range(1, len(self.slots))) or [0]
                slot = max(candidates, key=lambda s: (self._score(self.slots[s], now), s))
                self.slots[slot] = rank
                self.outputs[slot].outputs = self.board.screens[rank].stream_outputs(TAB_LINES)
                self._retitle()
            self.tab.selected_index = self.slots.index(rank)

    # -- which ranks the tabs hold ------------------------------------------------------

    def _score(self, rank: int, now: float) -> int:
        return many_ranks.worth_a_look(self.board, rank, now, self.root_cause)

    def _reassign(self, now: float) -> set[int]:
        """Each rank worth a look that no tab holds takes the tab of the rank least worth a look, if
        that one is less worth it (never rank 0's or the opened rank's); the slots whose rank changed."""
        moved: set[int] = set()
        order = many_ranks.ranked(self.board, many_ranks.PROBLEMS_FIRST, self.root_cause, now)
        for rank in order:
            score = self._score(rank, now)
            if score >= many_ranks.DOING_FINE:
                break  # ranked: the rest are doing fine too
            if rank in self.slots:
                continue
            free = [s for s in range(1, len(self.slots)) if self.slots[s] != self.opened]
            if not free:
                break
            slot = max(free, key=lambda s: (self._score(self.slots[s], now), s))
            if self._score(self.slots[slot], now) <= score:
                break  # every tab holds a rank as much worth a look: they keep their tabs
            self.slots[slot] = rank
            moved.add(slot)
        return moved

    def _retitle(self) -> None:
        titles = [tab_title(self.board, r) for r in self.slots]
        if titles != self.titles:
            self.titles = titles
            self.tab.titles = tuple(titles)

    def _grid_html(self) -> str:
        board = self.board
        logs = f" · logs: <code>{html.escape(self.log_dir)}</code>" if self.log_dir else ""
        return (
            f'<div style="line-height:1.4">{html.escape(many_ranks.counts_text(board))}'
            f'<small style="color:#666"> · {many_ranks.legend_html()}{logs}</small></div>'
            + many_ranks.grid_html(board, self.opened)
        )

    # -- the list -----------------------------------------------------------------------

    def _options(self) -> list[tuple[str, int]]:
        now = time.monotonic()
        ranks = many_ranks.listed(self.board, self.order.value, self.filter.value, self.root_cause, now)
        return many_ranks.labels(self.board, ranks, now)

    def _relist(self, _change: object = None) -> None:
        """The filter or the order changed: the list's ranks again (an answer to the page)."""
        with self._lock:
            self._set_options(self._options())

    def _relabel(self) -> None:
        """The same ranks in the same order, their labels now. Which ranks the list holds changes
        only on the page's say (the filter, the order): ipywidgets sends a click as the row's index,
        which a busy kernel reads at the cell's end; rows that moved meanwhile would open another
        rank than the one clicked."""
        ranks = [rank for _, rank in self.pick.options]
        self._set_options(many_ranks.labels(self.board, ranks, time.monotonic()))

    def _set_options(self, options: list[tuple[str, int]]) -> None:
        if options == list(self.pick.options):
            return
        self._listing = True
        try:
            self.pick.options = options
            self.pick.value = None
        finally:
            self._listing = False

    def _picked(self, change: dict[str, Any]) -> None:
        with self._lock:
            if self._listing or change["new"] is None:
                return
            self.opened = change["new"]
            self.select(change["new"])
            self._listing = True
            try:
                self.pick.value = None  # the same rank picked again is a change again
            finally:
                self._listing = False
            self.grid.value = self._grid_html()


def first_slots(board: RankBoard) -> list[int]:
    """Rank 0, then the first rank of each other node, then ranks in order: SLOTS ranks at most."""
    leaders = [r for r in range(1, len(board)) if board.nodes[r] != board.nodes[r - 1]]
    led = set(leaders)
    rest = [r for r in range(1, len(board)) if r not in led]
    return [0, *leaders, *rest][: min(SLOTS, len(board))]
