"""A session's end, as its cell says it: the lines quoted are that cell's, the states are the cell's.

Issue 49's probe: a rank that died in cell 2 was quoted with cell 1's traceback ("Last lines it
printed:"), because the call's tails run over the whole session; the channel's (per cell) are used.
And a cell whose error ended the session showed its root cause "killed" in the history, after
"failed" (the session's teardown came later).
"""

from __future__ import annotations

import signal

import pytest

from air_magic.backends.scripted import Rank, ScriptedBackend
from air_magic.errors import SessionEndedError

pytestmark = pytest.mark.unit


def step(n):
    """Never runs: the session's cells are scripted."""


def test_a_rank_that_dies_in_a_cell_is_quoted_with_that_cells_lines_only(session_of):
    cells = {
        1: [Rank(prints=["cell one said this"], raises=ValueError("cell one failed")), Rank()],
        2: [Rank(prints=["cell two said this"], killed_by=signal.SIGKILL), Rank(hangs=True)],
    }
    session = session_of(ScriptedBackend([Rank(), Rank()], cells=cells))
    with pytest.raises(ValueError, match="cell one failed"):
        session.run(step, 1)
    with pytest.raises(SessionEndedError, match="killed by SIGKILL") as caught:
        session.run(step, 2)
    text = str(caught.value.__cause__) + str(caught.value)
    assert "cell two said this" in text
    assert "cell one" not in text


def test_a_rank_that_dies_between_cells_is_not_quoted_with_the_last_cells_lines(session_of):
    cells = {1: [Rank(prints=["cell one said this"], raises=ValueError("cell one failed")), Rank()]}
    backend = ScriptedBackend([Rank(), Rank()], cells=cells)
    session = session_of(backend)
    with pytest.raises(ValueError):
        session.run(step, 1)
    assert session.call.last_lines(0, 10) == []  # the next error quotes only what comes after cell 1
