"""One root-cause rule (issue 49): a session's cell and a one-off call given the same failures name
the same rank in the exception, the tab marked failed and selected, the history line and the MLflow
tag. The failures are built so that a second rule would disagree: the root cause is rank 2 (its own
error, first); rank 0 fails later with a collective error (the lowest failed rank)."""

from __future__ import annotations

import inspect

import pytest

from air_magic.backends.scripted import Rank, ScriptedBackend
from air_magic.calls import history
from air_magic.calls.call import run_call
from air_magic.calls.persistent import Session
from air_magic.display import widgets
from air_magic.launch.settings import make_settings

pytest.importorskip("ipywidgets")
pytest.importorskip("mlflow")

ROOT = 2


class Diverged(ValueError):
    pass


def failing() -> list[Rank]:
    """The same failures for both: rank 2 raises first, rank 0's gloo error follows it."""
    collective = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"
    )
    return [Rank(raises=collective, at=0.5), Rank(hangs=True), Rank(raises=Diverged("loss is nan"), at=0.2)]


def train(step: int) -> None:
    """Never runs: the ranks are scripted."""


@pytest.fixture
def tabs(monkeypatch):
    """Every tab display the calls make, in order."""
    made: list[widgets.WidgetDisplay] = []

    class Kept(widgets.WidgetDisplay):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(widgets, "WidgetDisplay", Kept)
    return made


def said(tab: widgets.WidgetDisplay) -> tuple[int | None, str]:
    view = tab._view
    return view.tab.selected_index, view.tab.titles[ROOT]


def test_a_cell_and_a_call_name_the_same_root_cause_everywhere(store, tabs):
    settings = make_settings(num_accelerators=3, display="tabs", system_metrics=False, timeout=None)

    bound = inspect.signature(train).bind(1)
    call = run_call("train", train, bound, settings, backend=ScriptedBackend(failing()))
    call_info = history.last_run()
    call_tab = tabs[-1]

    session = Session(settings, backend=ScriptedBackend([Rank()] * 3, cells={1: failing()}))
    session.start()
    try:
        with pytest.raises(Diverged) as cell:
            session.run(train, 1)
        cell_info = history.last_run()
        cell_tab = tabs[-1]
    finally:
        session.stop(quiet=True)

    assert isinstance(call.error, Diverged)
    assert call.error.air_magic_rank == cell.value.air_magic_rank == ROOT  # the exception
    assert said(call_tab) == said(cell_tab) == (ROOT, f"rank {ROOT} ✗")  # the tab
    assert call_info is not None and cell_info is not None
    assert call_info.failed_rank == cell_info.failed_rank == ROOT  # the history line
    tags = [store.get_run(run_id).data.tags for run_id in (call_info.mlflow_run_id, session.record.run_id)]
    assert [t.get("air_magic.failed_rank") for t in tags] == [str(ROOT), str(ROOT)]  # the MLflow tag
