"""The widget view for many ranks (more than ``MANY_RANKS``): counts, a grid, the ranks worth a look.

A tab per rank is neither readable nor cheap at 64 ranks, let alone 1,000. This
view shows instead:

- the counts by state and a grid of every rank's glyph coloured by its state,
  node by node (``many_ranks.py``), refreshed at most every :data:`SLOW_S`;
- :data:`SLOTS` tabs of live output: rank 0 and the ranks worth a look
  (failed first, then stopped, then running ranks silent for long). A slot keeps
  its rank until a rank in a worse state needs it; the tabs switch in the browser,
  so this works while the kernel runs the cell;
- "open any rank": a filter (``737``, ``700-710``, ``node 3``, ``failed``) and the
  matching ranks; the one picked takes a tab (never rank 0's or a failed rank's). The kernel
  answers it when it is free: at once for a background call and after the call, at the cell's end for
  a foreground one (a busy kernel reads no message from the page: checked with
  ipykernel 7, docs/architecture.md "The view of many ranks").

What reaches the browser is bounded whatever the rank count: at most SLOTS tabs'
outputs every ``FLUSH_S`` (each a capped tail) and the grid (a few kilobytes)
every SLOW_S.
"""

from __future__ import annotations

import html
import time
from typing import Any

from air_magic.display import many_ranks, widget_parts
from air_magic.display.rank_board import RankBoard
from air_magic.protocol.events import RankState

SLOTS = 8  # tabs of live output: rank 0, the ranks worth a look, the rank opened last
SLOW_S = 1.0  # the counts, the grid and which ranks the tabs hold change at most this often

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
        self.slots = _first_slots(board)
        self.opened: int | None = None  # the rank picked in the list: its tab is not given to another
        self._last_slow = 0.0
        self._listing = False  # True while the list's options are replaced (not a pick)

        self.header = w.HTML(value=top_html, **widget_parts.html_kwargs())
        self.grid = w.HTML(value=self._grid_html(), **widget_parts.html_kwargs())
        self.outputs = [w.Output(layout=widget_parts.shared("output")) for _ in self.slots]
        self.tab = w.Tab(children=self.outputs, layout=widget_parts.shared("layout"))
        self.titles = [self._title(r) for r in self.slots]
        self.tab.titles = tuple(self.titles)
        self.filter = w.Text(placeholder="737, 700-710, node 3, failed", description="open rank")
        self.order = w.Dropdown(
            options=many_ranks.ORDERS, value=many_ranks.PROBLEMS_FIRST, description="order"
        )
        self.pick = w.Select(options=self._options(), rows=4, layout=w.Layout(width="100%"))
        self.help = w.HTML(value=_HELP, **widget_parts.html_kwargs())
        self.filter.observe(self._relist, names="value")
        self.order.observe(self._relist, names="value")
        self.pick.observe(self._picked, names="value")
        controls = w.HBox([self.filter, self.order])
        self.box = w.VBox(
            [self.header, self.grid, self.tab, controls, self.pick, self.help],
            layout=widget_parts.shared("layout"),
        )
        self.box.add_class("air-magic-run")
        self.box.add_class("air-magic-many-ranks")

    def widgets(self) -> list[Any]:
        return [
            self.box,
            self.header,
            self.grid,
            self.tab,
            *self.outputs,
            self.filter,
            self.order,
            self.pick,
            self.help,
            self.box.children[3],
        ]

    # -- refresh ------------------------------------------------------------------------

    def refresh(self, dirty: set[int], top_html: str, log_dir: str | None, force: bool = False) -> None:
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
            titles = [self._title(r) for r in self.slots]
            if titles != self.titles:
                self.titles = titles
                self.tab.titles = tuple(titles)
        for slot, rank in enumerate(self.slots):
            if rank in dirty or slot in moved:
                self.outputs[slot].outputs = self.board.screens[rank].stream_outputs()
        if force:
            self._relist()

    def select(self, rank: int) -> None:
        """Show ``rank``'s tab. If no tab holds it, it takes the last tab that holds neither rank 0
        nor a failed rank (the root cause stays in view)."""
        if rank not in self.slots:
            board = self.board
            keep = [s == 0 or board.states[r] is RankState.FAILED for s, r in enumerate(self.slots)]
            slot = next((s for s in range(len(self.slots) - 1, 0, -1) if not keep[s]), len(self.slots) - 1)
            self.slots[slot] = rank
            self.outputs[slot].outputs = board.screens[rank].stream_outputs()
            self.titles[slot] = self._title(rank)
            self.tab.titles = tuple(self.titles)
        self.tab.selected_index = self.slots.index(rank)

    # -- which ranks the tabs hold ------------------------------------------------------

    def _reassign(self, now: float) -> set[int]:
        """Ranks worth a look that no tab holds take the tabs of ranks that are not (rank 0's and the
        opened rank's tabs stay); the slots whose rank changed."""
        board = self.board
        worth = [
            r
            for r in many_ranks.ranked(board, many_ranks.PROBLEMS_FIRST, self.root_cause, now)
            if _worth_a_look(board, r, now)
        ]
        moved: set[int] = set()
        for rank in worth:
            if rank in self.slots:
                continue
            free = [
                s
                for s in range(len(self.slots) - 1, 0, -1)
                if self.slots[s] != self.opened and not _worth_a_look(board, self.slots[s], now)
            ]
            if not free:
                break
            self.slots[free[0]] = rank
            moved.add(free[0])
        return moved

    def _title(self, rank: int) -> str:
        return f"rank {rank} {many_ranks.GLYPHS[self.board.states[rank]]}"

    def _grid_html(self) -> str:
        board = self.board
        logs = f" · logs: <code>{html.escape(self.log_dir)}</code>" if self.log_dir else ""
        return (
            f'<div style="line-height:1.4">{html.escape(many_ranks.counts_text(board))}'
            f'<small style="color:#666"> · {many_ranks.legend_html()}{logs}</small></div>'
            + many_ranks.grid_html(board)
        )

    # -- the list -----------------------------------------------------------------------

    def _options(self) -> list[tuple[str, int]]:
        now = time.monotonic()
        order = self.order.value if hasattr(self, "order") else many_ranks.PROBLEMS_FIRST
        query = self.filter.value if hasattr(self, "filter") else ""
        ranks = many_ranks.listed(self.board, order, query, self.root_cause, now)
        return [(many_ranks.label(self.board, r, now), r) for r in ranks]

    def _relist(self, _change: object = None) -> None:
        self._listing = True
        try:
            self.pick.options = self._options()
            self.pick.value = None
        finally:
            self._listing = False

    def _picked(self, change: dict[str, Any]) -> None:
        if self._listing or change["new"] is None:
            return
        self.opened = change["new"]
        self.select(change["new"])


def _first_slots(board: RankBoard) -> list[int]:
    """Rank 0, then the first rank of each other node, then ranks in order: SLOTS ranks at most."""
    leaders = [r for r in range(1, len(board)) if board.nodes[r] != board.nodes[r - 1]]
    led = set(leaders)
    rest = [r for r in range(1, len(board)) if r not in led]
    return [0, *leaders, *rest][: min(SLOTS, len(board))]


def _worth_a_look(board: RankBoard, rank: int, now: float) -> bool:
    state = board.states[rank]
    if state in (RankState.FAILED, RankState.KILLED):
        return True
    return state is RankState.RUNNING and board.quiet_for(rank, now) >= many_ranks.QUIET_S
