"""A persistent session's rules with scripted ranks (backends/scripted.py): cells, errors, its end.

The session (calls/persistent.py) is the request's CellChannel; the scripted backend gives it a
CellSender and answers each cell as ``cells[number][rank]`` says, through the real call loop.
"""

from __future__ import annotations

import inspect
import signal
import threading

import pytest

from air_magic.backends.scripted import Rank, ScriptedBackend, _SourceCell
from air_magic.calls.history import last_run
from air_magic.errors import DistributedTimeoutError, SessionEndedError
from air_magic.protocol import serialization
from air_magic.worker import cell_runner


def step(n):
    """Never runs: the session's cells are scripted."""


class Diverged(ValueError):
    pass


def test_each_cell_answers_as_its_script_says(session_of):
    cells = {1: [Rank(prints=["cell 1 on rank 0"], returns=10), Rank(returns=11)], 3: [Rank(returns="x")] * 2}
    session = session_of(ScriptedBackend([Rank(), Rank()], cells=cells))
    assert session.run(step, 1) == [10, 11]
    assert session.run(step, 2) == [None, None]  # not in the script: every rank returns None
    assert session.run(step, 3) == ["x", "x"]
    assert session.alive() and session.cells == 3


def test_a_cell_that_raises_comes_back_as_its_own_error_and_the_session_goes_on(session_of):
    cells = {1: [Rank(returns=0), Rank(raises=Diverged("cell 1 failed"))]}
    session = session_of(ScriptedBackend([Rank(), Rank()], cells=cells))
    with pytest.raises(Diverged, match="cell 1 failed") as caught:
        session.run(step, 1)
    assert caught.value.air_magic_rank == 1
    assert last_run().rank_states == {0: "succeeded", 1: "failed"}
    assert session.alive() and session.run(step, 2) == [None, None]


def test_a_failed_cells_peers_still_in_it_are_interrupted(session_of):
    cells = {1: [Rank(hangs=True), Rank(raises=Diverged("nan"))]}
    session = session_of(ScriptedBackend([Rank(), Rank()], cells=cells))
    with pytest.raises(Diverged):
        session.run(step, 1)
    assert last_run().rank_states == {1: "failed", 0: "killed"}  # rank 0: "interrupted (SIGINT)"
    assert session.alive()


def test_a_cell_that_times_out_is_interrupted_and_the_session_goes_on(session_of):
    cells = {1: [Rank(prints=["waiting for rank 1"], hangs=True), Rank(returns=1)]}
    session = session_of(ScriptedBackend([Rank(), Rank()], cells=cells), timeout=0.3)
    with pytest.raises(DistributedTimeoutError) as caught:
        session.run(step, 1)
    text = str(caught.value)
    assert text.startswith("step timed out after 0.3 s (timeout=0.3); the cell was interrupted on every rank")
    assert "rank 0 was still running; its last lines:\n      waiting for rank 1" in text
    assert caught.value.still_running == [0] and session.alive()


def test_a_rank_that_dies_in_a_cell_ends_the_session(session_of):
    cells = {2: [Rank(killed_by=signal.SIGKILL), Rank(hangs=True)]}
    backend = ScriptedBackend([Rank(), Rank()], cells=cells)
    session = session_of(backend)
    session.run(step, 1)
    with pytest.raises(SessionEndedError, match="killed by SIGKILL") as caught:
        session.run(step, 2)
    assert "Every rank is gone" in str(caught.value)
    assert not session.alive() and backend.running() == []
    with pytest.raises(SessionEndedError):
        session.run(step, 3)


def test_a_stopped_session_ends_its_ranks_as_their_own_scripts_say(session_of, capsys):
    backend = ScriptedBackend([Rank(prints=["rank 0 set up"]), Rank()])
    session = session_of(backend)
    session.stop()
    assert f"session {session.id} stopped; every rank is gone" in capsys.readouterr().out
    assert not session.alive() and backend.stops == []  # each rank left its loop: none was stopped
    with open(last_run().log_path(0)) as f:
        assert f.read() == "rank 0 set up\n"  # said as it started, before it answered ready


def test_a_restarted_session_keeps_its_backend(session_of):
    backend = ScriptedBackend([Rank(), Rank()], cells={1: [Rank(returns=1), Rank(returns=2)]})
    session = session_of(backend)
    again = session.restart()
    try:
        assert again.run(step, 1) == [1, 2]  # scripted again: no process was started
    finally:
        again.stop(quiet=True)


# -- a source cell (Session.run_cell, %%distributed): each rank answers as worker/cell_runner.py does --


def in_a_rank(source: str) -> cell_runner.CellOutcome:
    """What a real rank's ``run_cell`` returns for ``source`` (worker/session_rank.py calls it so)."""
    return cell_runner.run_cell(source, "<cell>", {}, {}, [], namespace={})


def test_a_source_cell_answers_what_a_real_ranks_run_cell_returns(session_of):
    cells = {1: [Rank(returns=42)] * 2, 2: [Rank(), Rank()], 3: [Rank(returns=None)] * 2}
    session = session_of(ScriptedBackend([Rank(), Rank()], cells=cells))
    assert session.run_cell("6 * 7") == [42, 42]  # was AttributeError: 'int' object has no attribute 'value'
    assert session.run_cell("x = 6 * 7") == [None, None]  # no last expression: no value
    source = "print('no value')"
    bound = inspect.signature(cell_runner.run_cell).bind(source, "<cell>", {}, {}, [])
    answers = session.run_call("cell", cell_runner.run_cell, bound, kind="cell", source=source).unwrap()
    assert answers == [in_a_rank(source)] * 2  # the same CellOutcome, field for field
    assert answers[0].value == serialization.dumps_result(None)  # an expression's None, not "no value"
    scripted = _SourceCell(ends_with_expression=True, error=None).outcome(42)
    assert scripted == in_a_rank("6 * 7") and in_a_rank("x = 6 * 7") == _SourceCell(False, None).outcome(42)


def test_a_source_cell_whose_value_does_not_pickle_says_so_as_a_real_rank_does(session_of):
    cells = {1: [Rank(returns=threading.Lock())] * 2}
    session = session_of(ScriptedBackend([Rank(), Rank()], cells=cells))
    source = "threading.Lock()"
    bound = inspect.signature(cell_runner.run_cell).bind(source, "<cell>", {}, {}, [])
    answers = session.run_call("cell", cell_runner.run_cell, bound, kind="cell", source=source).unwrap()
    real = cell_runner.run_cell(source, "<cell>", {}, {"threading": "threading"}, [], namespace={})
    assert answers == [real] * 2 and real.value is None and "lock" in (real.value_error or "")


def test_a_cell_outcome_as_returns_is_sent_as_it_is(session_of):
    given = [cell_runner.CellOutcome(value=None, names={"w": serialization.dumps_result(3)}), in_a_rank("2")]
    session = session_of(ScriptedBackend([Rank(), Rank()], cells={1: [Rank(returns=o) for o in given]}))
    bound = inspect.signature(cell_runner.run_cell).bind("w = 3", "<cell>", {}, {}, ["w"])
    assert session.run_call("cell", cell_runner.run_cell, bound, kind="cell").unwrap() == given


def test_a_source_cell_that_raises_raises_what_a_real_ranks_run_cell_raises(session_of):
    with pytest.raises(ZeroDivisionError) as real:
        in_a_rank("1 / 0")
    cells = {1: [Rank(returns=0), Rank(raises=ZeroDivisionError("division by zero"))]}
    session = session_of(ScriptedBackend([Rank(), Rank()], cells=cells))
    with pytest.raises(type(real.value), match="division by zero") as caught:
        session.run_cell("1 / 0")
    assert caught.value.air_magic_rank == 1 and session.alive()
    with pytest.raises(SyntaxError, match="'return' outside function"):
        in_a_rank("return 1")
    with pytest.raises(SyntaxError, match="'return' outside function"):  # every rank that returns
        session.run_cell("return 1")
    assert last_run().rank_states == {0: "failed", 1: "failed"} and session.run_cell("1") == [None, None]
