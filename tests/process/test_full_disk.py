"""Full disks: a full temp folder under the ranks' metric files (issue 48 item 8), on a real small tmpfs.

Logging a metric never ends the training: the rows that cannot be written are counted and said
once, the rows logged once space returns are stored.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.tmpfs import small_tmpfs

from air_magic import paths

mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402

fault = pytest.mark.fault


def _store_env(store: os.PathLike) -> dict[str, str]:
    """This environment without MLflow's settings, the embedded store in ``store``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(AIR_MAGIC_MLFLOW_DIR=str(store), MLFLOW_DISABLE_TELEMETRY="true")
    return env


def _python(script: str, *args: object, env: dict[str, str], timeout: float = 300):
    """``python -c script args``, its output captured."""
    argv = [sys.executable, "-c", script, *map(str, args)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


# Each rank fills the temp folder, logs 5 metrics (not written), frees it, logs 3 (written).
FILL_AND_LOG = r"""
import os, sys, tempfile, time
import air_magic

@air_magic.distributed(num_accelerators=2, display="text", experiment="full-tmp")
def train():
    import mlflow
    import torch.distributed as dist
    air_magic.init_process_group()
    rank = int(os.environ["RANK"])
    filler = os.path.join(tempfile.gettempdir(), "filler")
    if rank == 0:
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"x" * 65536)
        except OSError:
            os.close(fd)
    dist.barrier()
    for step in range(5):
        mlflow.log_metric(f"loss_{rank}", 1.0, step=step)  # the metric file cannot grow
    dist.barrier()
    if rank == 0:
        os.remove(filler)
    dist.barrier()
    for step in range(5, 8):
        mlflow.log_metric(f"loss_{rank}", 0.5, step=step)
    dist.destroy_process_group()
    return rank

started = time.monotonic()
print("RESULT", train.distributed(), air_magic.last_run().tracking_url is not None)
print("TOOK", time.monotonic() - started)
"""


@fault(
    "the temp folder under the ranks' metric files is full while they log",
    "the training goes on; the rows not written counted and said once per rank; later rows stored",
)
def test_a_full_temp_folder_never_ends_the_training(tmp_path):
    with small_tmpfs(tmp_path / "tmp", "8m") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        store = tmp_path / "store"
        env.update(TMPDIR=str(tmp), AIR_MAGIC_MLFLOW_DIR=str(store), MLFLOW_DISABLE_TELEMETRY="true")
        env["AIR_MAGIC_WARM"] = "0"  # fresh ranks: no starter of this caller left in the tmpfs
        done = subprocess.run(
            [sys.executable, "-c", FILL_AND_LOG], capture_output=True, text=True, timeout=240, env=env
        )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "RESULT [0, 1]" in done.stdout, out[-4000:]
    for rank in (0, 1):
        mine = [line for line in out.splitlines() if f"[rank {rank}]" in line]
        assert len([line for line in mine if "metrics could not be written" in line]) == 1, out[-4000:]
        assert any("5 metric row(s) were not stored" in line for line in mine), out[-4000:]
    client = MlflowClient(f"sqlite:///{store}/{paths.MLFLOW_DB}")
    run = client.search_runs([client.get_experiment_by_name("full-tmp").experiment_id])[0]
    for rank in (0, 1):  # a key per rank: the store keeps one of two identical rows
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, f"loss_{rank}"))
        assert steps == [5, 6, 7], (rank, steps)


FAIL_WHILE_FULL = r"""
import os, tempfile
import air_magic

@air_magic.distributed(num_accelerators=1, display="none", tracking=False)
def train():
    fd = os.open(os.path.join(tempfile.gettempdir(), "filler"), os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"x" * 65536)
    except OSError:
        pass
    raise ValueError("boom while the disk is full")

try:
    train.distributed()
except Exception as exc:
    print("ERROR", type(exc).__name__, str(exc).replace(chr(10), " | "))
"""


@fault(
    "a rank fails while the temp folder holding its call folder is full",
    "the error says the error record could not be written and shows the rank's traceback",
)
def test_a_rank_failing_on_a_full_temp_folder_says_so(tmp_path):
    with small_tmpfs(tmp_path / "tmp", "4m") as tmp:
        env = {**os.environ, "TMPDIR": str(tmp), "AIR_MAGIC_WARM": "0"}
        done = subprocess.run(
            [sys.executable, "-c", FAIL_WHILE_FULL], capture_output=True, text=True, timeout=240, env=env
        )
    said = [line for line in done.stdout.splitlines() if line.startswith("ERROR")]
    assert said, done.stdout[-3000:] + done.stderr[-3000:]
    assert "its error record could not be written" in said[0], said[0]
    assert "ValueError: boom while the disk is full" in said[0], said[0]


LOG_THEN_WAIT = r"""
import os, sys, time
import air_magic

@air_magic.distributed(num_accelerators=2, display="none", experiment="killed-caller")
def train(flags):
    import mlflow
    rank = int(os.environ["RANK"])
    for step in range(300):
        mlflow.log_metric(f"loss_{rank}", 1.0 / (step + 1), step=step)
    open(os.path.join(flags, f"logged-{rank}"), "w").close()
    time.sleep(600)

train.distributed(sys.argv[1])
"""

NEXT_CALL = r"""
import air_magic

@air_magic.distributed(num_accelerators=1, display="none", experiment="killed-caller")
def nothing():
    return 1

print("NEXT", nothing.distributed())
"""


@fault(
    "the caller is SIGKILLed while its ranks' metric rows are on disk and not yet stored",
    "the next tracked call imports every row into the killed call's run, then ends it KILLED",
)
def test_a_killed_callers_metric_rows_reach_its_run(tmp_path):
    import signal
    import time

    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    store = tmp_path / "store"
    env.update(AIR_MAGIC_MLFLOW_DIR=str(store), MLFLOW_DISABLE_TELEMETRY="true")
    flags = tmp_path / "flags"
    flags.mkdir()
    caller = subprocess.Popen(
        [sys.executable, "-c", LOG_THEN_WAIT, str(flags)], env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while len(list(flags.iterdir())) < 2 and time.monotonic() < deadline and caller.poll() is None:
            time.sleep(0.05)
        assert len(list(flags.iterdir())) == 2, caller.stderr.read() if caller.poll() is not None else ""
    finally:
        caller.send_signal(signal.SIGKILL)  # right after the rows reached the files: most not stored
        caller.wait()
    # The ranks follow their caller (their lifeline); wait for them before the next call.
    time.sleep(2)
    done = subprocess.run(
        [sys.executable, "-c", NEXT_CALL], env=env, capture_output=True, text=True, timeout=240
    )
    assert "NEXT [1]" in done.stdout, done.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{store}/{paths.MLFLOW_DB}")
    runs = client.search_runs([client.get_experiment_by_name("killed-caller").experiment_id])
    killed = [r for r in runs if r.info.status == "KILLED"]
    assert len(killed) == 1, [r.info.status for r in runs]
    for rank in (0, 1):
        steps = sorted(m.step for m in client.get_metric_history(killed[0].info.run_id, f"loss_{rank}"))
        assert steps == list(range(300)), (rank, len(steps))


# Rank 0 fills the store's disk, then each rank logs 2,000 rows; three calls in one process: the
# store refuses (the run cannot be stored whole), still refuses (the call runs untracked), has
# room again (the first run is stored whole and ended).
FILL_STORE = r"""
import os, sys, time
import air_magic

ballast = os.path.join(sys.argv[1], "ballast")

@air_magic.distributed(num_accelerators=2, display="text", experiment="full-store")
def train(ballast, rows=2000):
    import mlflow
    rank = int(os.environ["RANK"])
    if rank == 0 and ballast:
        try:
            with open(ballast, "wb") as f:
                while True:
                    f.write(b"x" * (1 << 20))
                    f.flush()
        except OSError:
            pass
    for step in range(rows):
        mlflow.log_metric(f"loss_{rank}", 1.0 / (step + 1), step=step)
        if step % 500 == 0:
            time.sleep(0.6)  # the writer's passes see the store refuse
    return rank

started = time.monotonic()
print("FIRST", train.distributed(ballast), air_magic.last_run().mlflow_run_id, flush=True)
if sys.argv[2] == "exit":
    sys.exit(0)
# Untracked: the ranks' own MLflow calls go to a store of their call folder, a row at a time.
print("SECOND", train.distributed(ballast, 20), flush=True)
os.remove(ballast)
print("THIRD", train.distributed(None, 20), flush=True)
print("TOOK", time.monotonic() - started)
"""


def _fill_the_store(tmp_path, store_disk, then):
    env = _store_env(store_disk / "mlflow")
    done = _python(FILL_STORE, store_disk, then, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    first = next(line for line in done.stdout.splitlines() if line.startswith("FIRST"))
    assert first.startswith("FIRST [0, 1] "), first
    return env, out, first.split()[-1]


def _stored_whole(store_disk, run_id, rows=2000):
    client = MlflowClient(f"sqlite:///{store_disk}/mlflow/{paths.MLFLOW_DB}")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["air_magic.outcome"] == "succeeded", run
    for rank in (0, 1):
        steps = sorted(m.step for m in client.get_metric_history(run_id, f"loss_{rank}"))
        assert steps == list(range(rows)), (rank, len(steps))


@fault(
    "the embedded store's disk fills during a call",
    "the training goes on; one line while refused, one at the end with the rows kept on disk; "
    "the next call with room stores them and ends the run",
)
def test_a_store_disk_that_fills_mid_call_loses_no_row_and_leaves_no_run_running(tmp_path):
    with small_tmpfs(tmp_path / "store", "12m", mode="0700") as store_disk:
        _, out, run_id = _fill_the_store(tmp_path, store_disk, "stay")
        assert "SECOND [0, 1]" in out and "THIRD [0, 1]" in out, out[-4000:]
        # No SQL, no traceback from MLflow's store: a refusal is said in one line of its own.
        assert "Traceback" not in out and "[SQL:" not in out, out[-6000:]
        assert "mlflow.store.db.utils" not in out, out[-6000:]
        assert out.count("refused metric rows") == 1, out[-4000:]
        assert out.count(f"MLflow run {run_id} could not be stored whole") == 1, out[-4000:]
        assert "metric row(s) it did not take wait in" in out, out[-4000:]
        assert "this call runs UNTRACKED" in out, out[-4000:]  # the second call: the store is still full
        assert f"MLflow run {run_id} of an earlier call is stored whole now" in out, out[-4000:]
        _stored_whole(store_disk, run_id)


@fault(
    "the embedded store's disk fills during a call, and the process exits",
    "the next process's first tracked call stores the kept rows and ends the run with the call's outcome",
)
def test_a_run_the_full_store_refused_is_ended_by_the_next_process(tmp_path):
    with small_tmpfs(tmp_path / "store", "12m", mode="0700") as store_disk:
        env, out, run_id = _fill_the_store(tmp_path, store_disk, "exit")
        assert out.count(f"MLflow run {run_id} could not be stored whole") == 1, out[-4000:]
        os.remove(store_disk / "ballast")
        done = _python(NEXT_CALL.replace("killed-caller", "full-store"), env=env)
        assert "NEXT [1]" in done.stdout, done.stderr[-3000:]
        _stored_whole(store_disk, run_id)


# The store's disk left with a little room: the run is made and its end would fit, its rows not.
NEARLY_FULL = r"""
import os, sys
import air_magic

@air_magic.distributed(num_accelerators=2, display="none", experiment="nearly-full")
def train(rows):
    import os, time, mlflow
    rank = int(os.environ["RANK"])
    for step in range(rows):
        mlflow.log_metric(f"loss_{rank}", 1.0 / (step + 1), step=step)
        time.sleep(0.001)
    return rank

print("WARM", train.distributed(1), flush=True)  # the store's tables made
disk = sys.argv[1]
free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
with open(os.path.join(disk, "ballast"), "wb") as f:
    f.write(b"x" * max(0, free - 150_000))
print("FIRST", train.distributed(1500), air_magic.last_run().mlflow_run_id, flush=True)
"""


@fault(
    "the embedded store's disk has room for a run's end but not its rows, and the process exits",
    "the run is left RUNNING with its rows kept; the next process stores them and ends it",
)
def test_rows_a_nearly_full_store_refused_reach_their_run_from_the_next_process(tmp_path):
    with small_tmpfs(tmp_path / "store", "12m", mode="0700") as store_disk:
        env = _store_env(store_disk / "mlflow")
        done = _python(NEARLY_FULL, store_disk, env=env)
        out = done.stdout + done.stderr
        first = [line for line in done.stdout.splitlines() if line.startswith("FIRST [0, 1] ")]
        assert first, out[-4000:]
        run_id = first[0].split()[-1]
        assert f"MLflow run {run_id} could not be stored whole" in out, out[-4000:]
        os.remove(store_disk / "ballast")
        done = _python(NEXT_CALL.replace("killed-caller", "nearly-full"), env=env)
        assert "NEXT [1]" in done.stdout, done.stderr[-3000:]
        _stored_whole(store_disk, run_id, rows=1500)


FULL_BEFORE = r"""
import os, sys
import air_magic

@air_magic.distributed(num_accelerators=2, display="text", experiment="full-before")
def train():
    import os, mlflow
    mlflow.log_metric("loss", 0.5)
    return int(os.environ["RANK"])

print("WARM", train.distributed(), flush=True)  # the store's tables made
with open(os.path.join(sys.argv[1], "ballast"), "wb") as f:
    try:
        while True:
            f.write(b"x" * (1 << 20))
            f.flush()
    except OSError:
        pass
print("FULL", train.distributed(), flush=True)
"""


@fault(
    "the embedded store's disk is full before a call",
    "the call runs untracked with one line (no SQL, no traceback); the training runs",
)
def test_a_store_full_before_the_call_runs_it_untracked_in_one_line(tmp_path):
    with small_tmpfs(tmp_path / "store", "12m", mode="0700") as store_disk:
        done = _python(FULL_BEFORE, store_disk, env=_store_env(store_disk / "mlflow"))
    out = done.stdout + done.stderr
    assert "FULL [0, 1]" in done.stdout, out[-4000:]
    assert out.count("this call runs UNTRACKED") == 1, out[-4000:]  # the second call; the first tracked
    assert "Traceback" not in out and "[SQL:" not in out, out[-4000:]


def test_the_sweep_keeps_a_dead_callers_metric_folder_only_while_it_holds_rows_or_an_outcome(tmp_path):
    from air_magic import private_files

    sleeper = subprocess.Popen(["sleep", "30"])
    tag = private_files.process_tag(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    made = {}
    for what in ("empty", "rows", "outcome"):
        folder = tmp_path / f"{private_files.TEMP_PREFIX}{paths.METRICS_KIND}-{what}.{tag}"
        folder.mkdir()
        (folder / paths.METRICS_RUN_FILE).write_text("run")
        (folder / "rank-0.tsv").write_text("loss\t1.0\t1\t0\n" if what == "rows" else "")
        if what == "outcome":
            (folder / paths.METRICS_OUTCOME_FILE).write_text("succeeded")
        made[what] = folder
    removed = private_files.sweep_dead_callers(str(tmp_path))
    assert removed == [made["empty"].name], removed
    assert made["rows"].exists() and made["outcome"].exists()


def _prints_through_a_full_state_disk(flags):
    import os
    import time

    rank = int(os.environ["RANK"])

    def wait_for(name):
        while not os.path.exists(os.path.join(flags, name)):
            time.sleep(0.02)

    print(f"rank {rank} before", flush=True)
    open(os.path.join(flags, f"started-{rank}"), "w").close()
    wait_for("full")
    for line in range(300):
        print(f"rank {rank} line {line} while the state disk is full", flush=True)
    open(os.path.join(flags, f"printed-{rank}"), "w").close()
    wait_for("freed")
    print(f"rank {rank} after", flush=True)
    return rank


@fault(
    "the disk under the detached runs' folder (XDG_STATE_HOME) fills up mid-run",
    "the supervisor and its ranks go on; the run's events and end are written once there is room",
)
def test_a_full_state_disk_never_ends_a_detached_run(tmp_path, monkeypatch):
    """Was: the supervisor died at its first event that did not fit (its log empty, the run "lost")."""
    import time

    import psutil

    import air_magic

    with small_tmpfs(tmp_path / "state", size="2m") as state:
        monkeypatch.setenv("XDG_STATE_HOME", str(state))
        flags = tmp_path / "flags"
        flags.mkdir()
        fn = air_magic.distributed(num_accelerators=2, display="none", tracking=False, detach=True)
        handle = fn(_prints_through_a_full_state_disk).distributed_async(str(flags))
        deadline = time.monotonic() + 120
        while len(list(flags.glob("started-*"))) < 2:
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        (run,) = [r for r in air_magic.runs() if r.id == handle.detached_id]
        filler = _fill(state)
        (flags / "full").touch()
        while len(list(flags.glob("printed-*"))) < 2:
            assert time.monotonic() < deadline, "the ranks did not print"
            time.sleep(0.05)
        time.sleep(1.0)  # the supervisor tries to write what they printed, and its state
        assert psutil.pid_exists(run.pid) and psutil.Process(run.pid).status() != psutil.STATUS_ZOMBIE
        filler.unlink()
        (flags / "freed").touch()
        assert handle.result(timeout=120) == [0, 1]
        (ended,) = [r for r in air_magic.runs() if r.id == handle.detached_id]
        assert ended.status == "succeeded", ended
        again = air_magic.attach(handle.detached_id, display="none")
        assert again.result(timeout=60) == [0, 1]
        # What the ranks printed while the disk was full waited, and reached the event log in order.
        written = "".join(p.read_text() for p in sorted(Path(run.folder).glob("events*.jsonl")))
        for rank in (0, 1):
            marks = ("before", "line 0 ", "line 299 ", "after")
            at = [written.index(f"rank {rank} {what}") for what in marks]
            assert at == sorted(at), (rank, at)


def _works_until_cancelled(flags):
    import os
    import time

    rank = int(os.environ["RANK"])
    open(os.path.join(flags, f"started-{rank}"), "w").close()
    while True:
        print(f"rank {rank} works", flush=True)
        time.sleep(0.2)


def _fill(folder: Path) -> Path:
    """A file that takes every free block of ``folder``'s disk."""
    filler = folder / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"x" * 65536)
                f.flush()
        except OSError:
            pass
    return filler


@fault(
    "`air-magic cancel` of a detached run while the disk under the runs' folder (XDG_STATE_HOME) is full",
    "the ranks stop and the command says so within seconds, naming the full disk; the run ends "
    "'cancelled' once there is room",
)
def test_cancel_on_a_full_state_disk_stops_the_ranks_and_says_the_end_waits_for_room(tmp_path, monkeypatch):
    """Was: the command waited the grace and 10 s more in silence, then said "still stopping"
    (exit 1) of a run whose ranks were gone: its supervisor waited for room to write the end."""
    import time

    import psutil
    from helpers.cli import invoke

    import air_magic

    with small_tmpfs(tmp_path / "state", size="2m") as state:
        monkeypatch.setenv("XDG_STATE_HOME", str(state))
        flags = tmp_path / "flags"
        flags.mkdir()
        fn = air_magic.distributed(
            num_accelerators=2, display="none", tracking=False, detach=True, stop_grace=30
        )
        handle = fn(_works_until_cancelled).distributed_async(str(flags))
        deadline = time.monotonic() + 120
        while len(list(flags.glob("started-*"))) < 2 or len(handle.rank_pids) < 2:
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        pids = list(handle.rank_pids.values())
        filler = _fill(state)
        began = time.monotonic()
        cancelled = invoke("cancel", handle.detached_id, timeout=120)
        took = time.monotonic() - began
        assert cancelled.returncode == 0, (cancelled.stdout, cancelled.stderr)
        said = cancelled.stdout
        assert f"run {handle.detached_id} cancelled: every rank is gone" in said, said
        assert "waits for room on the full disk" in said and str(state) in said, said
        assert took < 30, f"{took:.1f} s: it waited out the grace (30 s), not the ranks' end"
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)
        assert not handle.done() and handle.why_not_ended() is not None
        filler.unlink()
        with pytest.raises(air_magic.LaunchError, match="stopped before it finished"):
            handle.result(timeout=120)
        assert handle.status == "cancelled" and handle.why_not_ended() is None
        (ended,) = [r for r in air_magic.runs() if r.id == handle.detached_id]
        assert ended.status == "cancelled", ended


@fault(
    "a detached run started while the disk under the runs' folder (XDG_STATE_HOME) is full",
    "a one-line LaunchError naming the folder and the fix (Python and `air-magic run --detach`); "
    "nothing starts, no folder stays",
)
def test_a_detached_run_on_a_full_state_disk_is_refused_in_one_line(tmp_path, monkeypatch):
    """Was: the OSError of writing the call's request, raised raw from wire.write_atomically."""
    from helpers.cli import invoke

    import air_magic

    with small_tmpfs(tmp_path / "state", size="1m") as state:
        monkeypatch.setenv("XDG_STATE_HOME", str(state))
        (state / "air_magic" / "detached").mkdir(parents=True, mode=0o700)
        filler = _fill(state)
        fn = air_magic.distributed(num_accelerators=2, display="none", tracking=False, detach=True)
        with pytest.raises(air_magic.LaunchError) as caught:
            fn(_works_until_cancelled).distributed_async(str(tmp_path))
        said = str(caught.value)
        assert "could not be started in" in said and str(state) in said, said
        assert "No space left on device" in said and "XDG_STATE_HOME" in said, said
        assert len(said.splitlines()) == 1, said
        assert os.listdir(state / "air_magic" / "detached") == []  # no half-made run stays
        script = tmp_path / "job.py"
        script.write_text("print('ran')\n")
        done = invoke("run", "--detach", "--no-tracking", "-n", "1", str(script), timeout=120)
        assert done.returncode == 1, (done.stdout, done.stderr)
        assert "Traceback" not in done.stderr and "could not be started in" in done.stderr, done.stderr
        assert os.listdir(state / "air_magic" / "detached") == []
        filler.unlink()
