"""Every air_magic error survives a pickle round trip (issue 31, item 1).

A detached run's result reaches whoever attaches as a pickle; an error that
cannot be rebuilt there (keyword-only constructor arguments) used to kill the
follower's thread and leave its handle "running" for ever. The tree is walked,
so an error added later is covered or this test names it.
"""

from __future__ import annotations

import importlib
import pickle
import pkgutil

import pytest

import air_magic
from air_magic import errors
from air_magic.protocol import serialization

_SAMPLES = {
    "DistributedTimeoutError": dict(still_running=[0, 1], log_dir="/logs/run"),
    "RankFailedError": dict(rank=1, exit_code=-9, log_dir="/logs/run/rank-1.log", remote_traceback="tb"),
}


def _every_error_class() -> list[type[errors.AirMagicError]]:
    for module in pkgutil.walk_packages(air_magic.__path__, "air_magic."):
        if ".ray" in module.name or module.name.endswith("__main__"):
            continue  # Ray's modules import ray (an extra); none of them defines an error
        importlib.import_module(module.name)
    found, todo = [], [errors.AirMagicError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


@pytest.mark.parametrize("dumps", [pickle.dumps, serialization.dumps], ids=["pickle", "cloudpickle"])
def test_every_error_of_the_tree_survives_a_pickle_round_trip(dumps):
    classes = _every_error_class()
    assert len(classes) >= 9, classes
    for cls in classes:
        err = cls("it went wrong", **_SAMPLES.get(cls.__name__, {}))
        err.__cause__ = errors.RemoteTraceback("Traceback from rank 1 of 2:\n  ValueError: bad batch")
        errors.add_note(err, "[air_magic] raised on rank 1 of 2")
        err.air_magic_rank = 1
        back = pickle.loads(dumps(err))
        assert type(back) is cls and str(back) == "it went wrong" and back.args == err.args, cls
        assert back.__dict__ == err.__dict__, cls  # keyword arguments, notes, what air_magic set on it
        assert isinstance(back.__cause__, errors.RemoteTraceback)
        assert back.__cause__.text == err.__cause__.text
        assert back._render_traceback_() == err._render_traceback_(), cls


def test_a_cause_that_is_not_a_ranks_traceback_is_not_carried():
    err = errors.LaunchError("no rank started")
    err.__cause__ = OSError("fork failed")  # may be anything, picklable or not: only text travels
    back = pickle.loads(pickle.dumps(err))
    assert back.__cause__ is None and str(back) == "no rank started"
