"""The tab display's state machine, driven by launch events (the browser test shows it rendered)."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")
from IPython.utils.capture import capture_output

from air_magic.display.widgets import WidgetDisplay
from air_magic.protocol.events import (
    RankExited,
    RankOutput,
    RankStarted,
    RankState,
    RecordLink,
    RunFinished,
    RunStarted,
    Tick,
)


def test_tabs_follow_the_ranks_and_a_failure_selects_and_marks_its_tab():
    display = WidgetDisplay(record=RecordLink("abc", "MLflow run abc in experiment 1: sqlite:///x"))
    with capture_output():
        started = RunStarted(
            "run-1", 3, "gloo", "no NVIDIA GPU (CPU mode)", True, "/logs/run-1", "train",
        )  # fmt: skip
        display.handle(started)
    for rank in range(3):
        display.handle(RankStarted(rank, 100 + rank))
    display.handle(RankOutput(0, "stdout", "epoch 1\n"))
    display.handle(RankOutput(2, "stderr", "\r 10%|#\r100%|##########|\n"))
    display.handle(Tick(0.5))
    display.handle(RankExited(2, RankState.FAILED, 1, "raised an exception"))
    display.handle(RankExited(0, RankState.KILLED, -15, "stopped by air_magic"))
    display.handle(RankExited(1, RankState.KILLED, -15, "stopped by air_magic"))
    display.handle(RunFinished("run-1", "failed", 1.5, "/logs/run-1", error="ValueError: x", failed_rank=2))

    assert display._view.tab.selected_index == 2
    assert list(display._view.tab.titles) == ["rank 0 ■", "rank 1 ■", "rank 2 ✗"]
    assert display._view.outputs[0].outputs == (
        {"output_type": "stream", "name": "stdout", "text": "epoch 1\n"},
    )
    # A bar redrawn on stderr is progress, not an error: not shaded like one (a stdout output).
    assert display._view.outputs[2].outputs == (
        {"output_type": "stream", "name": "stdout", "text": "100%|##########|\n"},
    )
    header = display._view.header.value
    assert "failed" in header and "raised an exception" in header and "MLflow run abc" in header
    assert "/logs/run-1" in header and "rank-2.log" in header  # the folder once, each rank's log in its row


def test_updates_are_batched_in_time():
    display = WidgetDisplay()
    with capture_output():
        display.handle(RunStarted("run-2", 1, "gloo", "cpu", True, "/logs/run-2", "chatty"))
    display.handle(RankStarted(0, 1))
    sent = []
    display._view.outputs[0].observe(lambda change: sent.append(change), names="outputs")
    for i in range(5000):
        display.handle(RankOutput(0, "stdout", f"line {i}\n"))
    display.handle(RunFinished("run-2", "succeeded", 0.1, "/logs/run-2"))
    assert len(sent) <= 3  # not one update per line
    assert display._board.screens[0].text().splitlines()[-1] == "line 4999"
    assert display._board.screens[0].dropped == 4000  # the tab keeps the last 1000 lines


def test_only_the_newest_ended_calls_keep_live_widgets(monkeypatch):
    from air_magic.display import widgets

    class Handle:  # the display id's handle: what the frontend is told to show in place
        def __init__(self):
            self.shown = []

        def update(self, bundle, raw=False):
            self.shown.append(bundle)

    monkeypatch.setattr(widgets, "KEEP_LIVE", 3)
    monkeypatch.setattr(widgets, "_ended", widgets.collections.deque())
    displays = []
    with capture_output():
        for i in range(5):
            display = WidgetDisplay()
            display.handle(RunStarted(f"run-{i}", 2, "gloo", "cpu", True, f"/logs/run-{i}", "cell"))
            display._handle = Handle()
            display.handle(RankOutput(0, "stdout", f"line of call {i}\n"))
            display.handle(RunFinished(f"run-{i}", "succeeded", 0.1, f"/logs/run-{i}"))
            displays.append(display)
    closed = [d._view.box.comm is None and all(o.comm is None for o in d._view.outputs) for d in displays]
    assert closed == [True, True, False, False, False]
    assert list(widgets._ended) == displays[2:]
    widget_view = "application/vnd.jupyter.widget-view+json"
    last = displays[0]._handle.shown[-1]  # the static record in its place: state, last lines, logs
    assert (
        widget_view not in last
        and "line of call 0" in last["text/html"]
        and "/logs/run-0" in last["text/html"]
    )
    assert widget_view in displays[4]._handle.shown[-1]
