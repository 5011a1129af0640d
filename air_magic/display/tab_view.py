"""The widget view for a few ranks (up to ``MANY_RANKS``): a compact state table and one tab per rank.

Built and refreshed by :class:`~air_magic.display.widgets.WidgetDisplay`, which
keeps each rank's state in a :class:`~air_magic.display.rank_board.RankBoard`.
Switching tabs happens in the browser alone: it works while the kernel is busy
running the cell (a foreground call), when no message from the page reaches it.
"""

from __future__ import annotations

import html
from typing import Any

from air_magic.display import widget_parts
from air_magic.display.rank_board import COLORS, GLYPHS, RankBoard, tab_title

_PAD = "padding:0 10px 0 0;line-height:1.3"
_CELL = f'style="{_PAD}"'


class TabView:
    def __init__(self, board: RankBoard, top_html: str, log_dir: str | None) -> None:
        import ipywidgets as w

        self.board = board
        self.log_dir = log_dir
        n = len(board)
        # Few widgets, their layouts and style shared: each widget is a message to the browser and
        # about 1 ms of the kernel's time, which a persistent session's cell pays every time (SPEC §15).
        self.header = w.HTML(value=self._header_html(top_html), **widget_parts.html_kwargs())
        self.outputs = [w.Output(layout=widget_parts.shared("output")) for _ in range(n)]
        self.tab = w.Tab(children=self.outputs, layout=widget_parts.shared("layout"))
        self.titles = [tab_title(self.board, r) for r in range(n)]
        self.tab.titles = tuple(self.titles)
        self.box = w.VBox([self.header, self.tab], layout=widget_parts.shared("layout"))
        self.box.add_class("air-magic-run")

    def widgets(self) -> list[Any]:
        return [self.box, self.tab, self.header, *self.outputs]

    def refresh(self, dirty: set[int], top_html: str, log_dir: str | None, force: bool = False) -> None:
        self.log_dir = log_dir
        for rank in sorted(dirty):
            self.outputs[rank].outputs = self.board.screens[rank].stream_outputs()
        titles = [tab_title(self.board, r) for r in range(len(self.board))]
        if titles != self.titles:
            self.titles = titles
            self.tab.titles = tuple(titles)
        header = self._header_html(top_html)
        if header != self.header.value:
            self.header.value = header

    def select(self, rank: int) -> None:
        self.tab.selected_index = rank

    def _header_html(self, top_html: str) -> str:
        """The top line, then one short row per rank: state, time, how it ended, its log's name (the
        folder is said once, under the table)."""
        board = self.board
        rows = []
        for r, state in enumerate(board.states):
            colour, glyph = COLORS[state], GLYPHS[state]
            dropped = board.screens[r].dropped
            shown = f" ({dropped} earlier lines only in the log)" if dropped else ""
            log = f"rank-{r}.log" if self.log_dir else ""
            rows.append(
                f'<tr><td {_CELL}>rank {r}</td><td style="{_PAD};color:{colour}">{glyph} {state.value}</td>'
                f"<td {_CELL}>{board.took(r)}</td><td {_CELL}>{html.escape(board.reasons[r])}</td>"
                f'<td {_CELL}><small style="color:#666"><code>{log}</code>{shown}</small></td></tr>'
            )
        logs = ""
        if self.log_dir:
            logs = (
                f'<div><small style="color:#666">logs: <code>{html.escape(self.log_dir)}</code></small></div>'
            )
        return (
            f"{top_html}"
            '<table style="font-size:90%;border-collapse:collapse;margin:2px 0">'
            + "".join(rows)
            + f"</table>{logs}"
        )
