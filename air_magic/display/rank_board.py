"""Each rank's state as the widget views show it: its screen, state, times and how much it printed.

Filled by :class:`~air_magic.display.widgets.WidgetDisplay` from launch events;
read by its two views (``tab_view.py`` for a few ranks, ``summary_view.py``
for many) and by the static record. Memory is bounded per rank: a screen keeps
a capped tail (fewer lines per rank when there are many ranks), never the log.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from air_magic.display.screen import MAX_LINE_CHARS, MAX_LINES, RankScreen
from air_magic.protocol.events import RankState

MANY_RANKS = 16  # past this many ranks the displays summarise instead of showing every rank
# Past MANY_RANKS, what each rank's screen keeps: the 20 lines its tab and the record show (a tab's
# update is about 20 KB at most), each line and the unfinished one of each stream cut at 1,000
# characters. 1,000 ranks thus hold 22 million characters at the very worst (about 90 MB if every
# one took 4 bytes; a few MB for lines of ordinary length).
MANY_RANKS_LINES = 20
MANY_RANKS_LINE_CHARS = 1000


# How every widget view shows a rank's state.
GLYPHS = {
    RankState.STARTING: "○",
    RankState.RUNNING: "●",
    RankState.SUCCEEDED: "✓",
    RankState.FAILED: "✗",
    RankState.KILLED: "■",
}
COLORS = {
    RankState.STARTING: "#888",
    RankState.RUNNING: "#1a73e8",
    RankState.SUCCEEDED: "#188038",
    RankState.FAILED: "#d93025",
    RankState.KILLED: "#b06000",
}


@dataclass
class RankBoard:
    screens: list[RankScreen] = field(default_factory=list)
    states: list[RankState] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    started_at: list[float | None] = field(default_factory=list)
    ended_at: list[float | None] = field(default_factory=list)
    last_output_at: list[float | None] = field(default_factory=list)
    lines_out: list[int] = field(default_factory=list)  # newlines printed (both streams)
    nodes: list[int] = field(default_factory=list)  # each rank's node index
    t0: float = 0.0

    @classmethod
    def of(cls, world_size: int, nodes: list[int] | None = None) -> RankBoard:
        few = world_size <= MANY_RANKS
        lines = MAX_LINES if few else MANY_RANKS_LINES
        chars = MAX_LINE_CHARS if few else MANY_RANKS_LINE_CHARS
        return cls(
            screens=[RankScreen(max_lines=lines, max_line_chars=chars) for _ in range(world_size)],
            states=[RankState.STARTING] * world_size,
            reasons=[""] * world_size,
            started_at=[None] * world_size,
            ended_at=[None] * world_size,
            last_output_at=[None] * world_size,
            lines_out=[0] * world_size,
            nodes=nodes if nodes is not None and len(nodes) == world_size else [0] * world_size,
            t0=time.monotonic(),
        )

    def __len__(self) -> int:
        return len(self.states)

    @property
    def many(self) -> bool:
        return len(self.states) > MANY_RANKS

    def output(self, rank: int, stream: str, text: str) -> None:
        self.screens[rank].write(stream, text)
        self.last_output_at[rank] = time.monotonic()
        self.lines_out[rank] += text.count("\n")

    def started(self, rank: int) -> None:
        self.states[rank] = RankState.RUNNING
        self.started_at[rank] = time.monotonic()

    def exited(self, rank: int, state: RankState, reason: str) -> None:
        self.states[rank] = state
        self.reasons[rank] = reason
        self.ended_at[rank] = time.monotonic()

    def took(self, rank: int) -> str:
        start, end = self.started_at[rank], self.ended_at[rank]
        return "" if start is None else f"{((end or time.monotonic()) - start):.1f} s"

    def quiet_for(self, rank: int, now: float) -> float:
        """Seconds since the rank last printed (since it started, if it never did); 0 once it ended."""
        if self.ended_at[rank] is not None:
            return 0.0
        last = self.last_output_at[rank] or self.started_at[rank] or self.t0
        return now - last


def on_nodes(nodes: int) -> str:
    """`` on 125 nodes``, or nothing for one node: how every display says where many ranks ran."""
    return f" on {nodes} nodes" if nodes > 1 else ""


def tab_title(board: RankBoard, rank: int) -> str:
    """A rank's tab title: ``rank 737 ✗`` (the glyph of its state)."""
    return f"rank {rank} {GLYPHS[board.states[rank]]}"


def counts_words(states: Sequence[RankState]) -> str:
    """``990 succeeded, 1 failed, 9 killed`` (states in their life's order)."""
    counts = Counter(states)
    return ", ".join(f"{counts[s]} {s.value}" for s in RankState if counts[s])
