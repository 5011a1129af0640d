"""A bad script is refused when it is written (backends/scripted.py), not late or as a crash."""

from __future__ import annotations

import signal

import pytest

from air_magic.backends.scripted import Rank, ScriptedBackend
from air_magic.errors import ConfigurationError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("keywords", "said"),
    [
        ({"raises": "oops"}, "raises takes an exception"),
        ({"killed_by": 999}, "killed_by takes a signal"),
        ({"at": -1}, "at is seconds after the start"),
    ],
)
def test_a_rank_that_cannot_be_played_is_refused(keywords, said):
    with pytest.raises(ConfigurationError, match=said):
        Rank(**keywords)


def test_a_signal_given_as_its_number_is_one():
    assert Rank(killed_by=9).killed_by == signal.SIGKILL


@pytest.mark.parametrize(
    ("cells", "said"),
    [
        ({1: Rank()}, r"cells\[1\] takes one Rank per rank"),
        ({1: [Rank()] * 3}, r"cells\[1\] has 3 rank\(s\) scripted, the session 2"),
        ({0: [Rank()] * 2}, "0 is not a cell number"),
        ({"a": [Rank()] * 2}, "'a' is not a cell number"),
    ],
)
def test_cells_that_cannot_be_played_are_refused_with_the_backend(cells, said):
    with pytest.raises(ConfigurationError, match=said):
        ScriptedBackend([Rank(), Rank()], cells=cells)
