"""What a view of many ranks shows: counts, a grid coloured by state, the ranks worth a look first.

Pure functions over a :class:`~air_magic.display.rank_board.RankBoard`, used by
the summary view (``summary_view.py``); no widget here, so the rules are tested
without a kernel. The sizes are bounded whatever the rank count: the grid merges
neighbouring ranks in one state into one run of glyphs (a few kilobytes for 1,000
ranks when neighbours share their state; about 50 KB if every other rank differs),
and the list names at most :data:`LISTED` ranks (a filter finds any other).
"""

from __future__ import annotations

import html
import re

from air_magic.display.rank_board import COLORS, GLYPHS, RankBoard, counts_words, on_nodes
from air_magic.protocol.events import RankState

LISTED = 40  # ranks named in the list at once; the filter reaches every other
QUIET_S = 30.0  # a running rank silent this long is called quiet in its label

PROBLEMS_FIRST = "failed, then quiet longest"
MOST_OUTPUT = "printed most"
RANK_ORDER = "rank order"
ORDERS = (PROBLEMS_FIRST, MOST_OUTPUT, RANK_ORDER)


def ranked(board: RankBoard, order: str, root_cause: int | None, now: float) -> list[int]:
    """Every rank, in the order the list shows them."""
    ranks = range(len(board))
    if order == MOST_OUTPUT:
        return sorted(ranks, key=lambda r: (-board.lines_out[r], r))
    if order == RANK_ORDER:
        return list(ranks)

    def problems(r: int) -> tuple[int, float, int]:
        score = worth_a_look(board, r, now, root_cause)
        if board.states[r] in (RankState.FAILED, RankState.KILLED):
            return (score, board.ended_at[r] or 0.0, r)  # the first to end first
        return (score, -board.quiet_for(r, now), r)  # the quiet longest first

    return sorted(ranks, key=problems)


DOING_FINE = 5  # worth_a_look's score for a rank that is not


def worth_a_look(board: RankBoard, rank: int, now: float, root_cause: int | None = None) -> int:
    """How much a rank is worth a look, lower first: 0 the root cause, 1 failed, 2 stopped, 3 running
    but silent for QUIET_S; DOING_FINE otherwise. The one rule of the list's order and the tabs."""
    if rank == root_cause:
        return 0
    state = board.states[rank]
    if state is RankState.FAILED:
        return 1
    if state is RankState.KILLED:
        return 2
    if state is RankState.RUNNING and board.quiet_for(rank, now) >= QUIET_S:
        return 3
    return DOING_FINE


_RANK = re.compile(r"^[0-9]+$")
_RANGE = re.compile(r"^([0-9]+)\s*-\s*([0-9]+)$")
_NODE = re.compile(r"^(?:node|n)\s*([0-9]+)$")


def matching(board: RankBoard, query: str) -> list[int] | None:
    """The ranks a filter names, in rank order; None for an empty filter (every rank).

    Terms separated by commas, any of: ``737`` (a rank), ``700-710`` (a range), ``node 3``
    (a node's ranks), a state (``failed``, ``running``, ``killed``, ...). Unknown terms match nothing.
    """
    terms = [t.strip().lower() for t in query.split(",") if t.strip()]
    if not terms:
        return None
    states = {s.value: s for s in RankState}
    chosen: set[int] = set()
    n = len(board)
    for term in terms:
        if _RANK.match(term):
            if int(term) < n:
                chosen.add(int(term))
        elif (found := _RANGE.match(term)) is not None:
            chosen.update(range(int(found[1]), min(int(found[2]), n - 1) + 1))
        elif (found := _NODE.match(term)) is not None:
            node = int(found[1])
            chosen.update(r for r in range(n) if board.nodes[r] == node)
        elif term in states:
            chosen.update(r for r in range(n) if board.states[r] is states[term])
    return sorted(chosen)


def listed(board: RankBoard, order: str, query: str, root_cause: int | None, now: float) -> list[int]:
    """The ranks the list names: the filter's, in the chosen order, at most :data:`LISTED`."""
    allowed = matching(board, query)
    ranks = ranked(board, order, root_cause, now)
    if allowed is not None:
        keep = set(allowed)
        ranks = [r for r in ranks if r in keep]
    return ranks[:LISTED]


def labels(board: RankBoard, ranks: list[int], now: float) -> list[tuple[str, int]]:
    """The list's entries: ``(label, rank)``."""
    nodes = len(set(board.nodes)) > 1
    return [(label(board, r, now, nodes), r) for r in ranks]


def label(board: RankBoard, rank: int, now: float, nodes: bool = True) -> str:
    """One line for a rank in the list: ``rank 737 ✗ failed · node 92 · 1,204 lines · raised ...``."""
    state = board.states[rank]
    parts = [f"rank {rank} {GLYPHS[state]} {state.value}"]
    if nodes:
        parts.append(f"node {board.nodes[rank]}")
    parts.append(f"{board.lines_out[rank]:,} lines")
    quiet = board.quiet_for(rank, now)
    if state is RankState.RUNNING and quiet >= QUIET_S:
        parts.append(f"quiet {quiet:.0f} s")
    if board.reasons[rank]:
        parts.append(board.reasons[rank])
    return " · ".join(parts)


def counts_text(board: RankBoard) -> str:
    """``1000 ranks: 998 running, 1 failed, 1 killed`` (states in their life's order)."""
    said = counts_words(board.states)
    return f"{len(board)} ranks{on_nodes(len(set(board.nodes)))}: {said}"


def grid_html(board: RankBoard, chosen: int | None = None) -> str:
    """Every rank as a glyph coloured by its state, node by node; neighbours in one state are one run
    (one element), so the grid costs a few kilobytes for 1,000 ranks. The chosen rank is underlined."""
    out: list[str] = []
    n = len(board)
    start = 0
    while start < n:
        node = board.nodes[start]
        end = start
        while end < n and board.nodes[end] == node:
            end += 1
        out.append(f'<span title="node {node}: ranks {start}-{end - 1}" style="margin-right:6px">')
        run = start
        while run < end:
            state = board.states[run]
            stop = run
            while stop < end and board.states[stop] is state and stop != chosen:
                stop += 1
            if stop == run:  # the chosen rank: a run of its own, underlined
                stop = run + 1
                out.append(f'<u style="color:{COLORS[state]}">{GLYPHS[state]}</u>')
            else:
                out.append(f'<span style="color:{COLORS[state]}">{GLYPHS[state] * (stop - run)}</span>')
            run = stop
        out.append("</span>")
        start = end
    return (
        '<div style="font-family:monospace;line-height:1.1;letter-spacing:1px;word-break:break-all">'
        + "".join(out)
        + "</div>"
    )


def legend_html() -> str:
    return " ".join(
        f'<span style="color:{COLORS[s]}">{GLYPHS[s]}</span>&nbsp;{html.escape(s.value)}' for s in RankState
    )
