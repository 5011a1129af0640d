"""Detached runs (SPEC §14): ranks under a supervisor that outlives its caller; attach from elsewhere.

The caller is a real process (tests/helpers/detached_caller.py) killed with
SIGKILL, as a kernel dies; the test attaches from its own process, sees what
was printed before it attached and what came after, and gets the result. The
MLflow run must say how the run really ended; another user cannot attach.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers.cli import invoke
from helpers.paths import HELPERS
from helpers.procs import gone_within
from helpers.ranks import mlflow_status

import air_magic
from air_magic.calls.history import RunInfo
from air_magic.errors import ConfigurationError, LaunchError
from air_magic.launch.accelerators import GPU, AcceleratorPlan

fault = pytest.mark.fault
CALLER = HELPERS / "detached_caller.py"


def _start_and_kill_the_caller(gate: Path) -> str:
    """Start a detached run from a caller process, SIGKILL the caller; the run's id."""
    caller = subprocess.Popen([sys.executable, str(CALLER), str(gate)], stdout=subprocess.PIPE, text=True)
    try:
        run_id = caller.stdout.readline().strip()
        assert run_id, "the caller printed no run id"
        _wait_for(lambda: _status(run_id) == "running", "the detached run to start")
    finally:
        caller.kill()
        caller.wait()
        caller.stdout.close()
    return run_id


def _status(run_id: str) -> str | None:
    found = [r for r in air_magic.runs() if r.id == run_id]
    return found[0].status if found else None


def _wait_for(predicate, what: str, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _mlflow(run: air_magic.RunHandle) -> str:
    state = run_state(run)
    return mlflow_status(RunInfo("", "", 0, "", mlflow_run_id=state["mlflow_run_id"]))


def run_state(handle) -> dict:
    import json

    (found,) = [r for r in air_magic.runs() if r.id == handle.detached_id]
    return json.loads(Path(found.folder, "state.json").read_text())


@fault(
    "the caller (kernel) is killed while a detached run runs",
    "the run goes on; attach from another process: the whole log, then the result; run FINISHED",
)
def test_a_detached_run_outlives_its_caller_and_attaches_elsewhere(store, tmp_path, capsys):
    gate = tmp_path / "gate"
    run_id = _start_and_kill_the_caller(gate)
    listed = {r.id: r for r in air_magic.runs()}
    assert listed[run_id].status == "running" and listed[run_id].world_size == 2
    _wait_for(
        lambda: (
            "rank 1 before the gate" in Path(listed[run_id].log_dir, "rank-1.log").read_text()
            if listed[run_id].log_dir and Path(listed[run_id].log_dir, "rank-1.log").exists()
            else False  # the folder is named (RunStarted) a moment before its logs are opened
        ),
        "rank 1's first line",
    )
    handle = air_magic.attach(run_id[:15] if run_id[:15] != run_id else run_id, display="text")
    _wait_for(lambda: handle.log_dir is not None, "the replay")
    gate.touch()
    assert handle.result(timeout=120) == [0, 10]
    out = capsys.readouterr().out
    for rank in (0, 1):  # what was printed before the attach, then what came after
        assert out.index(f"[rank {rank}] rank {rank} before the gate") < out.index(
            f"[rank {rank}] rank {rank} after the gate"
        )
    assert handle.status == "succeeded" and _status(run_id) == "succeeded"
    assert _mlflow(handle) == "FINISHED"
    assert "rank 0 after the gate" in handle.logs(0)
    # After the result its supervisor ends the MLflow run and uploads the logs, then exits: about
    # 2 s here, more on a loaded machine (no_leftovers gives it only 5).
    _wait_for(lambda: not _supervisors(), "the supervisor to exit", seconds=60)


def _supervisors() -> list[psutil.Process]:
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "air_magic.calls.supervisor" in " ".join(proc.cmdline()) and proc.status() != "zombie":
                found.append(proc)
        except psutil.Error:
            pass
    return found


@fault("cancel() of a detached run from another process", "every rank gone within 5 s; run KILLED")
def test_cancelling_an_attached_run_stops_it(store, tmp_path):
    run_id = _start_and_kill_the_caller(tmp_path / "gate")
    handle = air_magic.attach(run_id, display="none")
    _wait_for(lambda: all("before the gate" in handle.logs(r) for r in (0, 1)), "both ranks at the gate")
    pids = list(handle.rank_pids.values())
    dump = handle.stacks()  # taken from this process: the ranks are not its children
    assert all("waits" in dump[rank] for rank in (0, 1)), dump
    shown = invoke("stack", run_id, "1")  # the command line's way: rank 1 only
    assert shown.returncode == 0 and "  rank 1:" in shown.stdout and "waits" in shown.stdout, shown
    assert "  rank 0:" not in shown.stdout
    assert handle.cancel() is True
    assert gone_within(pids)
    assert handle.status == "cancelled" and _status(run_id) == "cancelled"
    with pytest.raises(LaunchError, match="stopped before it finished"):
        handle.result()
    assert _mlflow(handle) == "KILLED"


@fault(
    "a detached run's supervisor is killed (SIGKILL)",
    "its ranks die with it; attach says so; runs() shows it lost; the next call marks its run KILLED",
)
def test_a_killed_supervisor_takes_its_ranks_and_is_reported(store, tmp_path):
    run_id = _start_and_kill_the_caller(tmp_path / "gate")
    handle = air_magic.attach(run_id, display="none")
    _wait_for(lambda: len(handle.rank_pids) == 2, "the replay of both ranks' start")
    _wait_for(lambda: all("before the gate" in handle.logs(r) for r in (0, 1)), "both ranks at the gate")
    pids = list(handle.rank_pids.values())
    (run,) = [r for r in air_magic.runs() if r.id == run_id]
    written = lambda: "".join(p.read_text() for p in Path(run.folder).glob("events*.jsonl"))  # noqa: E731
    _wait_for(lambda: written().count("before the gate") == 2, "their lines in the event log")
    os.kill(run.pid, signal.SIGKILL)
    assert gone_within(pids)
    with pytest.raises(LaunchError, match="ended without a result"):
        handle.result(timeout=60)
    assert _status(run_id) == "lost"
    # The command line replays what the lost run's ranks printed, then says why (was: the one line).
    shown = invoke("attach", run_id)
    assert shown.returncode == 1, (shown.stdout, shown.stderr)
    assert "before the gate" in shown.stdout and "ended without a result" in shown.stderr, shown
    assert "Traceback" not in shown.stderr, shown.stderr
    air_magic.distributed(num_accelerators=2, display="none")(lambda: 1).distributed()  # reaps orphans
    assert _mlflow(handle) == "KILLED"


def test_a_detached_runs_gpus_are_refused_to_other_calls(tmp_path, monkeypatch):
    """Fake GPUs (the machine has none): the plan says GPUs, the ranks never touch CUDA."""
    gpus = (GPU(0, "GPU-cccc", "NVIDIA H100 80GB HBM3"),)
    plan = AcceleratorPlan(world_size=1, gpus=gpus, detected="GPU_1xH100")
    monkeypatch.setattr("air_magic.backends.local.backend.plan_accelerators", lambda *a: plan)
    gate = tmp_path / "gate"

    def waits(gate):
        import os
        import time

        while not os.path.exists(gate):
            time.sleep(0.02)
        return 1

    fn = air_magic.distributed(display="none", tracking=False, detach=True)(waits)
    first = fn.distributed_async(str(gate))
    try:
        with pytest.raises(ConfigurationError, match=r"GPU 0, which detached run .* share_gpus=True"):
            fn.with_overrides(detach=False).distributed(str(gate))
    finally:
        gate.touch()
        assert first.result(timeout=120) == [1]


def test_a_foreground_detached_call_and_a_detached_cell(ip, tmp_path):
    fn = air_magic.distributed(num_accelerators=2, display="none", tracking=False, detach=True)(
        lambda x: x + 1
    )
    assert fn.distributed(1) == [2, 2]
    handle = ip.run_cell(
        "%%distributed -n 2 --detach --background --display none --no-tracking\nz = 5\nz * 2"
    ).result
    assert handle.result(timeout=120) == [10, 10]
    assert ip.user_ns.pop("z") == 5
    again = air_magic.attach(handle.detached_id, display="none")  # as another kernel would see it
    assert again.result(timeout=60) == [10, 10]


def test_a_detached_run_is_private_to_its_user(tmp_path):
    fn = air_magic.distributed(num_accelerators=2, display="none", tracking=False, detach=True)(lambda: 3)
    handle = fn.distributed_async()
    assert handle.result(timeout=120) == [3, 3]
    (run,) = [r for r in air_magic.runs() if r.id == handle.detached_id]
    for folder in (run.folder, os.path.dirname(run.folder)):
        info = os.stat(folder)
        assert info.st_uid == os.getuid() and info.st_mode & 0o777 == 0o700, folder
    for name in os.listdir(run.folder):  # the files too: another user reads nothing of the run
        assert os.stat(os.path.join(run.folder, name)).st_mode & 0o077 == 0, name
    if os.geteuid() != 0:
        return  # only root can hand a folder to another user, to show that it is refused
    os.chown(run.folder, 65534, 65534)
    try:
        with pytest.raises(ConfigurationError, match="belongs to another user"):
            air_magic.attach(run.id)
    finally:
        os.chown(run.folder, os.getuid(), os.getgid())


def test_the_magics_list_and_attach_detached_runs(ip, capsys):
    handle = ip.run_cell("%%distributed -n 2 --detach --background --display none --no-tracking\n7").result
    assert handle.result(timeout=120) == [7, 7]
    capsys.readouterr()
    ip.run_line_magic("distributed", "runs")
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith(handle.detached_id)]
    assert row and "succeeded" in row[0] and "2 rank(s)" in row[0]
    again = ip.run_line_magic("distributed", f"attach {handle.detached_id}")
    assert again.result(timeout=60) == [7, 7]


def test_a_detached_run_keeps_its_metrics_and_mlflow_run(store):
    def logs_metrics():
        import os

        import mlflow

        rank = int(os.environ["RANK"])
        for step in range(5):
            # Each rank's own value: two ranks' rows alike in the same millisecond are one row in
            # MLflow's table (its key is the whole row), which made this test flaky.
            mlflow.log_metric("loss", rank + 1.0 / (step + 1), step=step)
        return rank

    fn = air_magic.distributed(num_accelerators=2, display="none", detach=True)(logs_metrics)
    handle = fn.distributed_async()
    assert handle.result(timeout=120) == [0, 1]
    state = run_state(handle)
    run = store.get_run(state["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    history = store.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]  # both ranks' rows
    assert run.data.tags["air_magic.run_id"] == handle.detached_id  # one id for the run everywhere


@fault(
    "cancel() at once, while the supervisor is still starting",
    "the run ends cancelled (never lost); no rank left",
)
def test_a_cancel_while_the_supervisor_starts_is_kept(tmp_path):
    fn = air_magic.distributed(num_accelerators=2, display="none", tracking=False, detach=True)(_sleeps)
    handle = fn.distributed_async()
    assert handle.cancel() is True
    assert handle.status == "cancelled" and _status(handle.detached_id) == "cancelled"


def _sleeps():
    import time

    time.sleep(600)


class _NeedsKeywords(Exception):
    def __init__(self, message, *, step):
        super().__init__(message)
        self.step = step


def _fails(how):
    import os
    import signal
    import time

    if int(os.environ["RANK"]) == 1:
        if how == "signal":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "interrupt":
            raise KeyboardInterrupt
        if how == "keywords":
            raise _NeedsKeywords("bad batch", step=3)
    if how == "timeout":
        time.sleep(600)
    return 0


@fault(
    "a detached run fails (timeout, a rank SIGKILLed, KeyboardInterrupt, an exception with keyword-only "
    "arguments)",
    "its handle and a later attach() raise the failure; nothing waits for ever",
)
@pytest.mark.parametrize(
    "how, error, said",
    [
        ("timeout", air_magic.DistributedTimeoutError, "timed out after 3 s"),
        ("signal", air_magic.RankFailedError, "killed by SIGKILL"),
        ("interrupt", air_magic.RankFailedError, "raised KeyboardInterrupt"),
        ("keywords", Exception, "bad batch"),
    ],
)
def test_a_failed_detached_run_is_collected_by_its_handle_and_by_attach(how, error, said):
    timeout = 3 if how == "timeout" else None
    settings = dict(num_accelerators=2, display="none", tracking=False, detach=True, timeout=timeout)
    fn = air_magic.distributed(**settings)(_fails)
    handle = fn.distributed_async(how)
    with pytest.raises(error, match=said) as raised:
        handle.result(timeout=120)
    assert handle.status == ("timeout" if how == "timeout" else "failed")
    again = air_magic.attach(handle.detached_id, display="none")  # as another kernel would
    with pytest.raises(type(raised.value), match=said) as reraised:
        again.result(timeout=15)
    assert reraised.value.__dict__.keys() == raised.value.__dict__.keys()
    if how == "timeout":
        assert raised.value.still_running == reraised.value.still_running == [0, 1]


@fault(
    "a detached run's result cannot be read by a follower (a class it cannot load)",
    "the handle ends with an error that says so; it does not wait for ever",
)
def test_a_result_a_follower_cannot_load_ends_its_handle_with_a_clear_error(tmp_path):
    fn = air_magic.distributed(num_accelerators=1, display="none", tracking=False, detach=True)(lambda: 1)
    handle = fn.distributed_async()
    assert handle.result(timeout=120) == [1]
    (run,) = [r for r in air_magic.runs() if r.id == handle.detached_id]
    Path(run.folder, "result.pkl").write_bytes(b"\x80\x05cno_such_module\nThing\n.")
    again = air_magic.attach(run.id, display="none")
    with pytest.raises(LaunchError, match="could not be read here: ModuleNotFoundError"):
        again.result(timeout=15)


def _waits_for(gate):
    import os
    import time

    while not os.path.exists(gate):
        time.sleep(0.02)
    return 1


def test_an_attached_handle_counts_its_time_from_the_runs_start(tmp_path):
    """Issue 48 #17: a handle attached to a run that had run for seconds said 0.0 s."""
    import re

    gate = tmp_path / "gate"
    fn = air_magic.distributed(num_accelerators=2, display="none", tracking=False, detach=True)(_waits_for)
    first = fn.distributed_async(str(gate))
    try:
        _wait_for(lambda: _status(first.detached_id) == "running", "the detached run to start")
        time.sleep(2.5)
        again = air_magic.attach(first.detached_id, display="none")  # as another kernel would
        shown = repr(again)
        assert "running, 2 rank(s)" in shown, shown
        (took,) = re.findall(r", ([\d.]+) s", shown)
        assert float(took) >= 2.5, shown  # since the run's start, not since this attach
    finally:
        gate.touch()
    assert first.result(timeout=120) == [1, 1]
    assert again.result(timeout=60) == [1, 1]


@fault(
    "a detached run's supervisor is SIGKILLed while its ranks' metric rows are on disk and not yet stored",
    "the next tracked call imports every row into the run, then ends it KILLED",
)
def test_a_killed_supervisors_metric_rows_reach_its_run(store, tmp_path, monkeypatch):
    import tempfile

    # The supervisor's temp folder is $TMPDIR's (the session's private one is this process's
    # alone, tests/conftest.py): this process looks for its metric folder where a user's would.
    monkeypatch.setattr(tempfile, "tempdir", None)

    def logs_then_waits(flags):
        import os
        import time

        import mlflow

        rank = int(os.environ["RANK"])
        for step in range(300):
            mlflow.log_metric(f"loss_{rank}", 1.0 / (step + 1), step=step)
        open(os.path.join(flags, f"logged-{rank}"), "w").close()
        time.sleep(600)

    flags = tmp_path / "flags"
    flags.mkdir()
    fn = air_magic.distributed(num_accelerators=2, display="none", detach=True)(logs_then_waits)
    handle = fn.distributed_async(str(flags))
    _wait_for(lambda: len(list(flags.iterdir())) == 2, "both ranks to log their rows")
    _wait_for(lambda: len(handle.rank_pids) == 2, "both ranks' start")
    (run,) = [r for r in air_magic.runs() if r.id == handle.detached_id]
    pids = list(handle.rank_pids.values())
    os.kill(run.pid, signal.SIGKILL)  # right after the rows reached the files: most not stored
    # The supervisor too: its ranks see their lifeline close while it is still exiting, and a sweep
    # in that instant keeps the folders of a caller it cannot yet call dead (CI, stop 57).
    assert gone_within([*pids, run.pid], seconds=30)
    mlflow_run_id = run_state(handle)["mlflow_run_id"]
    air_magic.distributed(num_accelerators=1, display="none")(lambda: 1).distributed()  # reaps orphans
    left = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(f"air_magic-{handle.detached_id}-")]
    assert not left, left  # the dead supervisor's call folder (its arguments) went with that sweep
    killed = store.get_run(mlflow_run_id)
    assert killed.info.status == "KILLED", killed.info
    for rank in (0, 1):
        steps = sorted(m.step for m in store.get_metric_history(mlflow_run_id, f"loss_{rank}"))
        assert steps == list(range(300)), (rank, len(steps))


def test_attaching_to_a_run_of_an_older_version_shows_its_mlflow_link(store):
    """Before the RecordLink event, a supervisor named the MLflow run in state.json only: an attach
    shows it from there (its displays get the same event a run of today's version replays)."""
    from air_magic.protocol.events import RecordLink

    fn = air_magic.distributed(num_accelerators=1, display="none", detach=True)(_rank_of)
    handle = fn.distributed_async()
    assert handle.result(timeout=120) == [0]
    state = run_state(handle)
    (found,) = [r for r in air_magic.runs() if r.id == handle.detached_id]
    stripped = 0
    for part in Path(found.folder).glob("events*.jsonl"):  # as an older version wrote it
        lines = part.read_text().splitlines(keepends=True)
        kept = [line for line in lines if '"RecordLink"' not in line]
        stripped += len(lines) - len(kept)
        part.write_text("".join(kept))
    assert stripped == 1

    class Seen:
        def __init__(self):
            self.events = []

        def handle(self, event):
            self.events.append(event)

    seen = Seen()
    attached = air_magic.attach(handle.detached_id, display="none", consumers=[seen])
    assert attached.result(timeout=60) == [0]
    links = [e for e in seen.events if isinstance(e, RecordLink)]
    assert [link.run_id for link in links] == [state["mlflow_run_id"]]


def _rank_of():
    import os

    return int(os.environ["RANK"])


def test_a_run_that_has_ended_is_known_ended_as_soon_as_it_is_attached():
    """Issue 49 (second probe): attach returned before its follower had read the end, so
    ``air-magic cancel`` said "cancelled" and ``stack`` "(no rank is running)" of a finished run."""
    fn = air_magic.distributed(num_accelerators=1, display="none", detach=True)(_rank_of)
    handle = fn.distributed_async()
    assert handle.result(timeout=120) == [0]
    for _ in range(5):  # each time: the replay of the end is read before attach returns
        again = air_magic.attach(handle.detached_id, display="none")
        assert again.done() and again.status == "succeeded", again.status
    cancelled = invoke("cancel", handle.detached_id)
    assert cancelled.returncode == 0, cancelled.stderr
    assert f"run {handle.detached_id} had already ended (succeeded)" in cancelled.stdout, cancelled.stdout
    stack = invoke("stack", handle.detached_id)
    assert "has ended (succeeded): no stack to take" in stack.stdout, stack
