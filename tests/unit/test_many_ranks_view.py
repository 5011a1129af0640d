"""The view of many ranks (issue 34, item 4): counts, a grid, tabs for the ranks worth a look, the filter.

Driven by launch events as a call of 1,000 ranks on 125 nodes would send them; the browser test
shows it rendered with real ranks (tests/browser/test_browser.py).
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ipywidgets")
from IPython.utils.capture import capture_output

from air_magic.display import many_ranks, summary_view
from air_magic.display.rank_board import MANY_RANKS, RankBoard
from air_magic.display.summary_view import SummaryView
from air_magic.display.tab_view import TabView
from air_magic.display.widgets import WidgetDisplay
from air_magic.protocol.events import (
    RankExited,
    RankOutput,
    RankStarted,
    RankState,
    RunFinished,
    RunStarted,
    Tick,
)

WORLD, PER_NODE = 1000, 8


def _started(world: int = WORLD, per_node: int = PER_NODE) -> WidgetDisplay:
    display = WidgetDisplay()
    with capture_output():
        display.handle(
            RunStarted(
                "run-1", world, "gloo", "cpu", True, "/logs/run-1", "train", (per_node,) * (world // per_node)
            )
        )
    for rank in range(world):
        display.handle(RankStarted(rank, 1000 + rank))
    return display


def test_a_few_ranks_get_a_tab_each_and_many_get_the_summary():
    few = WidgetDisplay()
    with capture_output():
        few.handle(RunStarted("run-0", MANY_RANKS, "gloo", "cpu", True, "/logs/run-0", "train"))
    assert isinstance(few._view, TabView) and len(few._view.outputs) == MANY_RANKS
    many = _started(MANY_RANKS + 1, 1)
    assert isinstance(many._view, SummaryView) and len(many._view.outputs) == summary_view.SLOTS


def test_a_failure_among_a_thousand_ranks_takes_a_tab_and_is_shown_first():
    display = _started()
    view = display._view
    assert isinstance(view, SummaryView)
    assert view.slots[:4] == [0, 8, 16, 24]  # rank 0, then each other node's first rank
    for step in range(3):
        for rank in range(WORLD):
            display.handle(RankOutput(rank, "stdout", f"rank {rank} step {step}\n"))
        display.handle(Tick(step))
    display.handle(RankOutput(737, "stderr", "Traceback (most recent call last):\nValueError: bad batch\n"))
    display.handle(RankExited(737, RankState.FAILED, 1, "raised an exception"))
    for rank in range(WORLD):
        if rank != 737:
            display.handle(RankExited(rank, RankState.KILLED, -15, "stopped by air_magic"))
    display.handle(
        RunFinished("run-1", "failed", 3.0, "/logs/run-1", error="ValueError: bad batch", failed_rank=737)
    )

    assert 737 in view.slots and view.slots[0] == 0
    assert view.tab.selected_index == view.slots.index(737)
    shown = view.outputs[view.slots.index(737)].outputs
    assert shown[-1]["name"] == "stderr" and "ValueError: bad batch" in shown[-1]["text"]
    assert "1000 ranks on 125 nodes: 1 failed, 999 killed" in view.grid.value
    assert len(view.grid.value.encode()) < 20_000  # a few kilobytes whatever the rank count
    assert view.titles[view.slots.index(737)] == "rank 737 ✗"
    # The list keeps its ranks (a click read late must open the rank it showed), their labels follow;
    # asked again (the page's filter or order), failures first. The record lists a few ranks, not 1,000.
    assert view.pick.options[0] == ("rank 0 ■ killed · node 0 · 3 lines · stopped by air_magic", 0)
    view.order.value = many_ranks.RANK_ORDER
    view.order.value = many_ranks.PROBLEMS_FIRST
    assert view.pick.options[0] == ("rank 737 ✗ failed · node 92 · 5 lines · raised an exception", 737)
    bundle = display._bundle()
    assert "1 failed, 999 killed; listed here: 0, 737, 1, 2 (every" in bundle["text/plain"]
    assert bundle["text/plain"].count("\n  rank ") == 4 and "rank 737 failed" in bundle["text/plain"]
    assert len(bundle["text/html"].encode()) < 20_000


def test_output_reaches_the_browser_for_the_tabs_only_and_the_grid_at_most_every_second(monkeypatch):
    display = _started()
    view = display._view
    assert isinstance(view, SummaryView)
    sent: list[str] = []
    for slot, output in enumerate(view.outputs):
        output.observe(lambda change, slot=slot: sent.append(f"tab {slot}"), names="outputs")
    view.grid.observe(lambda change: sent.append("grid"), names="value")
    clock = [time.monotonic() + 10]
    monkeypatch.setattr(summary_view.time, "monotonic", lambda: clock[0])
    for step in range(20):  # 20 flushes a quarter of a second apart, every rank printing
        clock[0] += 0.25
        for rank in range(WORLD):
            display.handle(RankOutput(rank, "stdout", f"step {step}\n"))
        view.refresh(display._dirty, display._top_html(), "/logs/run-1")
        display._dirty.clear()
    assert sent.count("grid") <= 1  # the states did not change: the grid is not sent again
    assert all(sent.count(f"tab {s}") == 20 for s in range(summary_view.SLOTS))
    assert len(sent) <= summary_view.SLOTS * 20 + 1


def test_a_rank_quiet_for_long_takes_a_tab_that_held_a_rank_doing_fine(monkeypatch):
    display = _started()
    view = display._view
    assert isinstance(view, SummaryView)
    clock = [time.monotonic()]
    monkeypatch.setattr(summary_view.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr("air_magic.display.rank_board.time.monotonic", lambda: clock[0])
    for rank in range(WORLD):
        if rank != 512:
            display._board.output(rank, "stdout", "alive\n")
    clock[0] += many_ranks.QUIET_S + 1
    for rank in range(WORLD):
        if rank != 512:
            display._board.output(rank, "stdout", "still alive\n")
    view.refresh(set(), "", None, force=True)
    assert 512 in view.slots and view.slots[0] == 0
    view.filter.value = "512"
    label = {r: text for text, r in view.pick.options}[512]
    assert "quiet 31 s" in label


def test_a_failure_takes_a_tab_from_a_quiet_rank_and_the_list_picks_its_first_entry(monkeypatch):
    """Only rank 0 prints: after QUIET_S every other rank is quiet, which must not keep a failure out."""
    display = _started(64)
    view = display._view
    assert isinstance(view, SummaryView)
    clock = [time.monotonic()]
    monkeypatch.setattr(summary_view.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr("air_magic.display.rank_board.time.monotonic", lambda: clock[0])
    clock[0] += many_ranks.QUIET_S + 5
    display._board.output(0, "stdout", "rank 0 is the only one printing\n")
    view.refresh(set(), "", None, force=True)
    quiet_tabs = list(view.slots)
    display.handle(RankExited(41, RankState.FAILED, 1, "raised an exception"))
    view.refresh(set(), "", None, force=True)
    assert 41 in view.slots and view.slots[0] == 0 and len(set(view.slots) - set(quiet_tabs)) == 1
    view.filter.value = "failed"
    assert view.pick.value is None and [r for _, r in view.pick.options] == [41]
    view.pick.value = 41  # a click on the first entry: a change, since nothing was chosen
    assert view.tab.selected_index == view.slots.index(41) and view.pick.value is None


def test_a_retired_view_leaves_no_widget_model_behind():
    from ipywidgets.widgets.widget import _instances  # every open model (ipywidgets 8)

    before = set(_instances)
    display = _started(64)
    display.handle(RunFinished("run-1", "succeeded", 1.0, "/logs/run-1"))
    display.retire()
    assert set(_instances) - before <= {m.model_id for m in _shared_models()}


def _shared_models():
    from air_magic.display import widget_parts

    return list(widget_parts._SHARED.values())


def test_the_lists_ranks_stay_put_while_their_labels_follow_so_a_late_click_opens_what_it_showed():
    display = _started(64)
    view = display._view
    assert isinstance(view, SummaryView)
    shown = [r for _, r in view.pick.options]
    index = shown.index(30)  # the row the user clicked, read by the kernel only at the cell's end
    display.handle(RankExited(30, RankState.FAILED, 1, "raised an exception"))
    view.refresh(set(), "", None, force=True)
    assert [r for _, r in view.pick.options] == shown and "failed" in view.pick.options[index][0]
    view.pick.index = index
    assert view.slots[view.tab.selected_index] == 30


def test_any_rank_opens_from_the_filter_in_the_last_tab():
    display = _started()
    view = display._view
    assert isinstance(view, SummaryView)
    display.handle(RankOutput(421, "stdout", "hello from 421\n"))
    view.filter.value = "421"
    assert [r for _, r in view.pick.options] == [421]
    view.pick.value = 421  # what a click in the list does
    assert view.slots[-1] == 421 and view.tab.selected_index == summary_view.SLOTS - 1
    assert view.outputs[-1].outputs[0]["text"] == "hello from 421\n"
    view.filter.value = "node 3, 998-999"
    assert [r for _, r in view.pick.options] == [*range(24, 32), 998, 999]


def test_filter_terms():
    board = RankBoard.of(40, [r // 8 for r in range(40)])
    board.exited(7, RankState.FAILED, "raised")
    assert many_ranks.matching(board, "") is None
    assert many_ranks.matching(board, "7, 38-45") == [7, 38, 39]
    assert many_ranks.matching(board, "node 2") == list(range(16, 24))
    assert many_ranks.matching(board, "n4, failed") == [7, *range(32, 40)]
    assert many_ranks.matching(board, "no such thing") == []
    assert many_ranks.matching(board, "²") == []  # a digit to str.isdigit, not a rank
