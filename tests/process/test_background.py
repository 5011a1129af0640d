"""Long runs (SPEC §14): background calls and their handle, GPUs in use, every rank's stacks.

Real ranks, a real IPython shell and a real store. Rank functions wait on a gate
file the test creates, so "the handle came back while the ranks ran" is shown by
order, not by timing.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers.procs import gone_within
from helpers.ranks import mlflow_status, ready_starter

import air_magic
from air_magic.errors import ConfigurationError, DistributedTimeoutError, LaunchError
from air_magic.launch.accelerators import GPU, AcceleratorPlan
from air_magic.outcome import stacks as stack_taking

fault = pytest.mark.fault


def _wait_for_gate(gate: str) -> int:
    import os
    import time

    while not os.path.exists(gate):
        time.sleep(0.02)
    return int(os.environ["RANK"])


def stuck_here_forever(ready: str) -> None:
    import os
    import time

    open(f"{ready}.{os.environ['RANK']}", "w").close()
    while True:
        time.sleep(0.05)


def _hang(ready: str) -> None:
    stuck_here_forever(ready)


def _fail_on_rank_1(gate: str) -> int:
    rank = _wait_for_gate(gate)
    if rank == 1:
        raise ValueError("rank 1 does not like this batch")
    return rank


def _wait_for(predicate, seconds=120.0, what="the ranks to start") -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _ready(prefix: Path, n: int = 2) -> bool:
    return all(Path(f"{prefix}.{rank}").exists() for rank in range(n))


def test_a_background_call_returns_its_handle_while_the_ranks_run(store, tmp_path):
    gate = tmp_path / "gate"
    handle = air_magic.distributed(num_accelerators=2, display="none")(_wait_for_gate).distributed_async(
        str(gate)
    )
    assert isinstance(handle, air_magic.RunHandle)
    assert not handle.done() and handle.status in ("starting", "running")
    _wait_for(lambda: len(handle.rank_pids) == 2)
    assert not handle.done() and handle.status == "running"
    with pytest.raises(TimeoutError, match="still running"):
        handle.result(timeout=0.1)
    gate.touch()
    assert handle.result(timeout=120) == [0, 1]
    assert handle.done() and handle.status == "succeeded" and handle.exception() is None
    assert mlflow_status(air_magic.last_run()) == "FINISHED"
    assert "succeeded" in repr(handle) and handle.log_dir in repr(handle)


def test_a_failing_rank_reaches_the_handle_as_its_own_exception(store, tmp_path):
    gate = tmp_path / "gate"
    handle = air_magic.distributed(num_accelerators=2, display="none")(_fail_on_rank_1).distributed_async(
        str(gate)
    )
    gate.touch()
    with pytest.raises(ValueError, match="rank 1 does not like this batch"):
        handle.result(timeout=120)
    assert handle.status == "failed"
    assert isinstance(handle.exception(), ValueError)
    assert mlflow_status(air_magic.last_run()) == "FAILED"
    assert "ValueError: rank 1 does not like this batch" in handle.logs(1)


@fault("cancel() of a background run", "every rank gone within 5 s; status cancelled; run KILLED")
@pytest.mark.parametrize("warm_start", [True, False], ids=["warm", "fresh"])
def test_cancel_leaves_no_rank(store, tmp_path, warm_start):
    ready = tmp_path / "ready"
    fn = air_magic.distributed(num_accelerators=2, display="none", warm_start=warm_start)(_hang)
    handle = fn.distributed_async(str(ready))
    _wait_for(lambda: _ready(ready))
    pids = list(handle.rank_pids.values())
    assert handle.cancel() is True
    assert gone_within(pids)
    assert handle.status == "cancelled"
    with pytest.raises(LaunchError, match="stopped before it finished"):
        handle.result()
    assert mlflow_status(air_magic.last_run()) == "KILLED"


def test_other_calls_run_while_a_background_run_runs(tmp_path):
    """CPU ranks claim no GPU: a foreground call runs beside a background one."""
    gate = tmp_path / "gate"
    handle = air_magic.distributed(num_accelerators=2, display="none", tracking=False)(
        _wait_for_gate
    ).distributed_async(str(gate))
    quick = air_magic.distributed(num_accelerators=2, display="none", tracking=False)(lambda: 7)
    assert quick.distributed() == [7, 7]
    assert not handle.done()
    gate.touch()
    assert handle.result(timeout=120) == [0, 1]


def test_a_second_run_on_the_same_gpus_is_refused_unless_asked(tmp_path, monkeypatch):
    """The GPUs are faked (this machine has none): the ranks never touch CUDA, only the plan says GPUs."""
    gpus = (GPU(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3"), GPU(1, "GPU-bbbb", "NVIDIA H100 80GB HBM3"))
    plan = AcceleratorPlan(world_size=2, gpus=gpus, detected="GPU_2xH100")
    monkeypatch.setattr("air_magic.backends.local.backend.plan_accelerators", lambda *a: plan)
    gate = tmp_path / "gate"
    fn = air_magic.distributed(num_accelerators=2, display="none", tracking=False)(_wait_for_gate)
    first = fn.distributed_async(str(gate))
    try:
        with pytest.raises(ConfigurationError, match=r"GPU 0, 1, which _wait_for_gate .* share_gpus=True"):
            fn.distributed_async(str(gate))
        with pytest.raises(ConfigurationError, match="Nothing was started"):
            fn.distributed(str(gate))  # a foreground call too
        shared = fn.with_overrides(share_gpus=True).distributed_async(str(gate))
        gate.touch()
        assert shared.result(timeout=120) == [0, 1]
        assert first.result(timeout=120) == [0, 1]
    finally:
        first.cancel()
    gate.unlink()
    again = fn.distributed_async(str(gate))  # the GPUs were given back when the first ended
    gate.touch()
    assert again.result(timeout=120) == [0, 1]


@pytest.mark.parametrize(
    ("method", "warm_start"),
    [("signal", True), ("signal", False), ("py-spy", True)],
    ids=["signal-warm", "signal-fresh", "py-spy"],
)
def test_stacks_name_the_function_each_rank_hangs_in(tmp_path, monkeypatch, method, warm_start):
    monkeypatch.setenv("AIR_MAGIC_STACKS", method)
    if method == "py-spy" and stack_taking.py_spy_path() is None:
        pytest.fail("py-spy is part of the test extra ([debug]): pip install 'air_magic[test]'")
    ready = tmp_path / "ready"
    fn = air_magic.distributed(num_accelerators=2, display="none", tracking=False, warm_start=warm_start)(
        _hang
    )
    handle = fn.distributed_async(str(ready))
    try:
        _wait_for(lambda: _ready(ready))
        dump = handle.stacks()
        assert sorted(dump) == [0, 1]
        for rank in (0, 1):
            assert "stuck_here_forever" in dump[rank], dump[rank]
        shown = str(dump)
        assert shown.count("stuck_here_forever") == 2
        assert "wait_for_eof" not in shown  # air_magic's own lifeline thread is left out when shown
        kept = Path(handle.log_dir, "stacks.txt").read_text()
        assert kept.count("stuck_here_forever") == 2 and "on request" in kept
    finally:
        handle.cancel()


@fault(
    "a rank hangs until the timeout",
    "the timeout error shows each rank's stack (the function it hangs in); stacks.txt kept with the run",
)
def test_a_timeout_shows_where_each_rank_hangs_and_keeps_the_stacks(store, tmp_path):
    ready_starter()
    fn = air_magic.distributed(num_accelerators=2, display="none", timeout=4)(_hang)
    with pytest.raises(DistributedTimeoutError) as caught:
        fn.distributed(str(tmp_path / "ready"))
    text = str(caught.value)
    assert "What each rank was doing" in text
    assert text.count("stuck_here_forever") == 2, text
    info = air_magic.last_run()
    assert mlflow_status(info) == "FAILED"
    artifacts = [a.path for a in store.list_artifacts(info.mlflow_run_id, "logs")]
    assert "logs/stacks.txt" in artifacts


def test_the_magics_background_stack_and_cancel(ip, capsys, tmp_path):
    handle = ip.run_cell("%%distributed -n 2 --background --display none --no-tracking\nx = 40 + 2\nx").result
    assert isinstance(handle, air_magic.RunHandle)
    assert handle.result(timeout=120) == [42, 42]
    assert ip.user_ns["x"] == 42  # brought back by result(), on this thread

    gate = tmp_path / "ready"
    ip.user_ns["ready"] = str(gate)
    ip.user_ns["stuck_here_forever"] = stuck_here_forever
    hung = ip.run_cell(
        "%%distributed -n 2 --background --display none --no-tracking --push stuck_here_forever\n"
        "stuck_here_forever(ready)\n"
    ).result
    _wait_for(lambda: _ready(gate))
    capsys.readouterr()
    ip.run_line_magic("distributed", "stack 1")
    out = capsys.readouterr().out
    assert "rank 1:" in out and "rank 0:" not in out and "stuck_here_forever" in out
    ip.run_line_magic("distributed", "cancel")
    assert "cancelled; every rank is gone" in capsys.readouterr().out
    assert hung.status == "cancelled"
    for name in ("ready", "stuck_here_forever", "x"):
        ip.user_ns.pop(name, None)


def test_a_running_calls_log_folder_is_never_pruned(tmp_path):
    """A days-long run outlives a hundred short calls: its log folder stays while its process lives."""
    import json

    from air_magic import paths, private_files
    from air_magic.backends import output

    root = tmp_path / "runs"
    root.mkdir(mode=0o700)
    (root / "20200101-000000-000000").mkdir()  # the oldest: a live run of this process
    alive = {"outcome": "running", "owner": private_files.owner_tag()}
    Path(paths.run_summary(str(root / "20200101-000000-000000"))).write_text(json.dumps(alive))
    (root / "20200101-000001-000000").mkdir()  # a run whose process is gone: pruned as usual
    dead = {"outcome": "running", "owner": "1-1-" + private_files.owner_tag().split("-", 2)[2]}
    Path(paths.run_summary(str(root / "20200101-000001-000000"))).write_text(json.dumps(dead))
    for i in range(output.KEEP_RUNS):
        (root / f"20210101-{i:06d}-000000").mkdir()
    output._prune(str(root))
    left = sorted(p.name for p in root.iterdir())
    assert left[0] == "20200101-000000-000000" and "20200101-000001-000000" not in left
    assert len(left) == output.KEEP_RUNS + 1


def _hash_seed() -> str:
    import os

    return os.environ.get("PYTHONHASHSEED", "")


def test_two_calls_wanting_different_starters_do_not_close_each_others(capfd):
    """A background call waits for a starter with its start-up variables; a foreground call with
    others starts fresh ranks meanwhile instead of rebuilding (and closing) the first one's."""
    air_magic.restart_warm_start()
    fn = air_magic.distributed(num_accelerators=2, display="none", tracking=False)(_hash_seed)
    first = fn.with_overrides(env={"PYTHONHASHSEED": "1"}).distributed_async()
    assert fn.with_overrides(env={"PYTHONHASHSEED": "2"}).distributed() == ["2", "2"]
    assert first.result(timeout=180) == ["1", "1"]
    said = capfd.readouterr().err
    # Each call rebuilds at most once (before, each closed the other's starter every 0.2 s).
    assert said.count("restarting the warm starter") <= 2, said


_SCRIPT_THAT_LEAVES = """
import air_magic

@air_magic.distributed(num_accelerators=2, display="none")
def work():
    import time
    time.sleep(600)

handle = work.distributed_async()
{wait}
print("the script ends")
"""


@fault(
    "a script starts a background run and ends without waiting for it (at once, or once its ranks run)",
    "one line says the run is stopped; no rank is left; run.json says interrupted; its MLflow run "
    "is KILLED with the error tag",
)
@pytest.mark.parametrize("when", ["at-once", "running"])
def test_a_scripts_end_stops_its_background_runs_with_a_line_and_a_killed_run(store, tmp_path, when):
    import json
    import subprocess
    import sys

    wait = "while handle.status != 'running':\n    __import__('time').sleep(0.05)"
    wait = "" if when == "at-once" else wait
    script = tmp_path / "leaves.py"
    script.write_text(_SCRIPT_THAT_LEAVES.format(wait=wait))
    logs = tmp_path / "logs"
    env = {**__import__("os").environ, "AIR_MAGIC_LOG_DIR": str(logs)}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0 and "the script ends" in done.stdout, done.stderr
    said = [line for line in done.stderr.splitlines() if "background run work" in line]
    assert len(said) == 1 and "is stopped" in said[0], done.stderr
    assert "could not be imported" not in done.stderr, done.stderr
    (summary_path,) = logs.glob("*/run.json")
    summary = json.loads(summary_path.read_text())
    assert summary["outcome"] == "interrupted" and summary["world_size"] == 2
    run = store.get_run(summary["mlflow_run_id"])
    assert run.info.status == "KILLED" and "stopped before it finished" in run.data.tags["air_magic.error"]


def test_the_magics_say_a_background_run_is_starting(ip, capsys, monkeypatch):
    import threading

    from air_magic.calls.call import PreparedCall

    gate = threading.Event()
    original = PreparedCall.run

    def held(self, *args, **kwargs):  # as while its MLflow run is being made
        gate.wait(60)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PreparedCall, "run", held)
    fn = air_magic.distributed(num_accelerators=2, display="none", tracking=False)(lambda: 1)
    handle = fn.distributed_async()
    try:
        capsys.readouterr()
        for what in ("status", "logs 0", "stack"):
            ip.run_line_magic("distributed", what)
            out = capsys.readouterr().out
            assert "is starting in the background" in out and "no run yet" not in out, (what, out)
    finally:
        gate.set()
        assert handle.result(timeout=120) == [1, 1]  # even after a failed check: no rank left
    capsys.readouterr()
    ip.run_line_magic("distributed", "status")
    out = capsys.readouterr().out
    assert "rank 1: succeeded (exit status 0)" in out and "None" not in out, out
