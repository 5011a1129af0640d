"""The warm start: ranks forked from a starter that imported torch once (SPEC §10)."""

from __future__ import annotations

import os
import sys

import psutil
import pytest

from air_magic import distributed, restart_warm_start
from air_magic.node import warm


def _who_am_i():
    import os
    import random
    import sys

    return {
        "parent": os.getppid(),
        "torch_preloaded": "torch" in sys.modules,
        "random": random.random(),
        "cwd": os.getcwd(),
        "sys_path": list(sys.path),
        "rank": os.environ["RANK"],
        "omp": os.environ["OMP_NUM_THREADS"],
        "stdin": os.read(0, 1),
    }


def test_warm_ranks_are_forked_from_the_starter_yet_fresh(starter, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fn = distributed(num_accelerators=2, display="none", tracking=False)(_who_am_i)
    first, second = fn.distributed(), fn.distributed()
    for facts in first + second:
        assert facts["parent"] == starter.proc.pid and facts["torch_preloaded"]
        assert facts["cwd"] == str(tmp_path) and facts["sys_path"] == sys.path
        assert facts["stdin"] == b""  # /dev/null, as for a fresh rank
    assert [f["rank"] for f in first] == ["0", "1"]
    # Each fork reseeds: no two ranks, in one call or across calls, share a random sequence.
    randoms = [f["random"] for f in first + second]
    assert len(set(randoms)) == 4


def _parent():
    import os

    return os.getppid()


def test_a_starter_ready_just_after_a_calls_look_is_used(monkeypatch):
    """The starter's ready message may come between a call's look (its wait ran out) and its check
    whether one is still coming; the call must not then start fresh ranks beside a ready starter
    (found as a failure of the tracked-starter test below under CI's load). Made certain here: the
    call's first look waits for the starter to be ready, then answers None, as a look a moment too
    early does."""
    restart_warm_start()
    real = warm.get_starter
    early: list[warm.Starter | None] = []

    def look_a_moment_too_early(*args, **kwargs):
        if kwargs.get("hold") and not early:
            early.append(real(*args, **{**kwargs, "hold": False, "wait_s": 120}))
            return None
        return real(*args, **kwargs)

    monkeypatch.setattr(warm, "get_starter", look_a_moment_too_early)
    parents = distributed(num_accelerators=2, display="none", tracking=False)(_parent).distributed()
    assert early and early[0] is not None, "the starter did not come up"
    assert parents == [early[0].proc.pid] * 2, (parents, early[0].proc.pid, os.getpid())


def test_cold_ranks_when_asked(starter):
    facts = distributed(num_accelerators=2, display="none", tracking=False, warm_start=False)(
        _who_am_i
    ).distributed()
    assert {f["parent"] for f in facts} == {os.getpid()}


def test_the_starter_is_rebuilt_when_stale_and_on_request(starter, monkeypatch):
    first = starter.proc.pid
    restart_warm_start()
    assert not psutil.pid_exists(first) or psutil.Process(first).status() == psutil.STATUS_ZOMBIE
    second = warm.get_starter(wait_s=120)
    assert second is not None and second.proc.pid != first
    monkeypatch.setattr(warm, "fingerprint", lambda preload: "packages changed")
    third = warm.get_starter(wait_s=120)
    assert third is not None and third.proc.pid != second.proc.pid


def test_off_by_environment(monkeypatch):
    monkeypatch.setenv("AIR_MAGIC_WARM", "0")
    assert warm.get_starter() is None
    facts = distributed(num_accelerators=2, display="none", tracking=False)(_who_am_i).distributed()
    assert {f["parent"] for f in facts} == {os.getpid()}


def test_a_rank_error_from_a_warm_rank_is_the_same(starter):
    def boom():
        import os

        if os.environ["RANK"] == "1":
            raise LookupError("warm failure")
        return 0

    with pytest.raises(LookupError, match="warm failure") as info:
        distributed(num_accelerators=2, display="none", tracking=False)(boom).distributed()
    assert info.value.air_magic_rank == 1


def test_ranks_that_end_while_others_are_still_being_started(starter):
    """Exit reports of early ranks arrive while later ranks are spawned: they must not be taken
    for the answer to a spawn (that once made pid 1 a 'rank', so teardown signalled everything)."""
    import time

    fn = distributed(num_accelerators=8, display="none", tracking=False)(time.time)
    for _ in range(5):
        assert len(fn.distributed()) == 8
    info = __import__("air_magic").last_run()
    assert info is not None and info.outcome == "succeeded"


def _modules_a_rank_will_need():
    import sys

    return {name: name in sys.modules for name in ("psutil", "air_magic.worker.shutdown", "cloudpickle")}


def test_a_forked_rank_finds_what_it_needs_to_exit_already_imported(starter):
    """What every rank imports on its way out is preloaded in the starter, not imported per call
    (psutil at exit cost each warm call 15 ms when the lazy package stopped pulling it in)."""
    fn = distributed(num_accelerators=2, display="none", tracking=False)(_modules_a_rank_will_need)
    assert fn.distributed() == [{"psutil": True, "air_magic.worker.shutdown": True, "cloudpickle": True}] * 2


def _preloaded_for_tracking():
    import sys

    return "mlflow" in sys.modules, "mlflow.store.tracking.sqlalchemy_store" in sys.modules


def test_a_tracked_call_starts_a_starter_that_has_mlflow_imported(store):
    restart_warm_start()
    tracked = distributed(num_accelerators=2, display="none")(_preloaded_for_tracking)
    assert tracked.distributed() == [(True, True)] * 2  # a rank that logs skips 2-3 s of imports
    starter = warm.get_starter()
    # The extras are not part of the starter's identity: an untracked call uses it as it is.
    assert tracked.with_overrides(tracking=False).distributed() == [(True, True)] * 2
    assert warm.get_starter() is starter


def test_an_untracked_call_starts_a_starter_without_mlflow_and_a_tracked_call_keeps_it(store):
    restart_warm_start()
    untracked = distributed(num_accelerators=2, display="none", tracking=False)(_preloaded_for_tracking)
    assert untracked.distributed() == [(False, False)] * 2  # an untracked call waits for torch only
    starter = warm.get_starter()
    assert untracked.with_overrides(tracking=True).distributed() == [(False, False)] * 2
    assert warm.get_starter() is starter  # not rebuilt for the extras


def test_the_tracking_extras_follow_the_store_and_an_explicit_list(monkeypatch):
    monkeypatch.delenv("AIR_MAGIC_PRELOAD", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    store_module = "mlflow.store.tracking.sqlalchemy_store"
    assert warm.tracking_preload() == ["mlflow", store_module]  # the embedded store is sqlite
    for uri, expected in (
        ("sqlite:////tmp/x.db", ["mlflow", store_module]),
        ("postgresql+psycopg2://db/mlflow", ["mlflow", store_module]),
        ("http://127.0.0.1:5000", ["mlflow"]),
        ("databricks", ["mlflow"]),
        ("/tmp/mlruns", ["mlflow"]),
    ):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        assert warm.tracking_preload() == expected, uri
    monkeypatch.setenv("AIR_MAGIC_PRELOAD", "torch")
    assert warm.tracking_preload() == []  # the user's list is the whole list


def test_a_starter_still_importing_exits_when_its_caller_goes(tmp_path, monkeypatch):
    """A kernel shut down while its starter imports torch leaves no starter behind (no orphan)."""
    (tmp_path / "slow_preload.py").write_text("import time\ntime.sleep(60)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    starter = warm.Starter(["slow_preload"])
    try:
        assert not starter.is_ready(wait_s=1.0)  # importing: the watcher is what runs now
        starter.sock.close()  # the caller is gone (no close(): a killed kernel calls nothing)
        assert starter.proc.wait(timeout=20) == 0
    finally:
        if starter.proc.poll() is None:
            starter.proc.kill()
            starter.proc.wait()


def _nvml_check():
    import os

    return os.getppid(), os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")


def test_a_variable_the_kernels_imports_set_keeps_the_starter(starter, monkeypatch):
    """Lightning's import sets PYTORCH_NVML_BASED_CUDA_CHECK in the kernel (issue 48 item 16): read at
    each ``torch.cuda.is_available()``, it reaches the forked ranks and restarts no starter."""
    fn = distributed(num_accelerators=2, display="none", tracking=False)(_nvml_check)
    before = fn.distributed()
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    after = fn.distributed()
    assert [parent for parent, _ in before] == [parent for parent, _ in after] == [starter.proc.pid] * 2
    assert [value for _, value in after] == ["1", "1"]
