"""Per-step metrics from every rank: batched through the caller, nothing lost (issue #9).

Real ranks log through MLflow's fluent API into a real sqlite store (the file
store and an HTTP server are covered in test_tracking.py, whose helpers use the
same path); the assertions read the store back.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

mlflow = pytest.importorskip("mlflow")
from helpers.ranks import interrupt_tracked_caller  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

import air_magic  # noqa: E402
from air_magic import distributed  # noqa: E402


def last_run_id() -> str:
    info = air_magic.last_run()
    assert info is not None and info.mlflow_run_id
    return info.mlflow_run_id


def _log_steps(steps):

    import mlflow

    rank = int(os.environ["RANK"])
    for step in range(steps):
        mlflow.log_metric("loss", rank + step / 10_000, step=step)
        mlflow.log_metrics({f"rank{rank}/value": step * 2.5, f"rank{rank}/half": step / 2}, step=step)
    return hasattr(mlflow.log_metric, "__wrapped__")  # True: the batched path was in place


def test_four_ranks_logging_at_once_leave_every_metric_in_order(store):
    steps = 400
    batched = distributed(num_accelerators=4, display="none")(_log_steps).distributed(steps)
    assert batched == [True] * 4
    run_id = last_run_id()
    for rank in range(4):
        history = store.get_metric_history(run_id, f"rank{rank}/value")
        assert [(m.step, m.value) for m in history] == [(s, s * 2.5) for s in range(steps)]
        assert [m.value for m in store.get_metric_history(run_id, f"rank{rank}/half")] == [
            s / 2 for s in range(steps)
        ]
    loss = store.get_metric_history(run_id, "loss")
    assert sorted((m.step, m.value) for m in loss) == sorted(
        (s, r + s / 10_000) for r in range(4) for s in range(steps)
    )
    timestamps = [m.timestamp for m in store.get_metric_history(run_id, "rank0/value")]
    assert timestamps == sorted(timestamps)  # the times the rank logged them, in order


def test_the_switch_restores_mlflows_direct_path(store, monkeypatch):
    monkeypatch.setenv("AIR_MAGIC_METRICS", "direct")
    assert distributed(num_accelerators=2, display="none")(_log_steps).distributed(5) == [False, False]
    history = store.get_metric_history(last_run_id(), "rank1/value")
    assert [m.value for m in history] == [s * 2.5 for s in range(5)]


def _log_then_die(steps, done_dir):
    import time

    import mlflow

    rank = int(os.environ["RANK"])
    for step in range(steps):
        mlflow.log_metric(f"rank{rank}", step, step=step)
    open(os.path.join(done_dir, str(rank)), "w").close()
    if rank == 1:
        while len(os.listdir(done_dir)) < 2:  # both have logged
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


@pytest.mark.fault("a rank SIGKILLed after logging metrics", "every metric it logged is in the run")
def test_a_killed_rank_leaves_what_it_logged(store, tmp_path):
    done = tmp_path / "done"
    done.mkdir()
    with pytest.raises(air_magic.RankFailedError, match="rank 1 of 2 was killed by SIGKILL"):
        distributed(num_accelerators=2, display="none")(_log_then_die).distributed(300, str(done))
    run_id = last_run_id()
    assert store.get_run(run_id).info.status == "FAILED"
    for rank in (0, 1):
        assert [m.value for m in store.get_metric_history(run_id, f"rank{rank}")] == list(range(300))


def _log_then_hang(steps):

    import mlflow

    for step in range(steps):
        mlflow.log_metric(f"rank{os.environ['RANK']}", step, step=step)
    time.sleep(600)


@pytest.mark.fault("a timeout after ranks logged metrics", "every metric is in the run, which ends FAILED")
def test_a_timeout_keeps_the_metrics(store):
    with pytest.raises(air_magic.DistributedTimeoutError):
        distributed(num_accelerators=2, display="none", timeout=15)(_log_then_hang).distributed(200)
    run_id = last_run_id()
    assert store.get_run(run_id).data.tags["air_magic.outcome"] == "timeout"
    for rank in (0, 1):
        assert len(store.get_metric_history(run_id, f"rank{rank}")) == 200


@pytest.mark.fault("an interrupt after ranks logged metrics", "every metric is in the run, which ends KILLED")
def test_an_interrupt_keeps_the_metrics(store, tmp_path):
    out, err = interrupt_tracked_caller(tmp_path, metrics_per_rank=250)
    assert "interrupted" in out, err
    exp = store.get_experiment_by_name("interrupted")
    (run,) = store.search_runs([exp.experiment_id])
    assert run.info.status == "KILLED"
    for rank in (0, 1):
        assert len(store.get_metric_history(run.info.run_id, f"rank{rank}")) == 250


def _watch_own_metric():

    import mlflow
    from mlflow.tracking import MlflowClient

    run_id = os.environ["MLFLOW_RUN_ID"]  # (MLflow's start_run, called by log_metric, removes it)
    mlflow.log_metric("live", 1.0)
    client = MlflowClient()
    started = time.monotonic()
    while time.monotonic() - started < 60:
        if client.get_metric_history(run_id, "live"):
            return True  # seen in the store while this rank still runs
        time.sleep(0.05)
    return False


def test_metrics_reach_the_store_while_the_ranks_still_run(store):
    assert distributed(num_accelerators=2, display="none")(_watch_own_metric).distributed() == [True, True]


def _other_paths():

    import mlflow
    from mlflow.exceptions import MlflowException

    shared = os.environ["MLFLOW_RUN_ID"]
    rank = os.environ["RANK"]
    mlflow.log_metric("first", 0.0)  # makes the shared run the active one, as in MLflow
    with mlflow.start_run(run_name=f"own-{rank}", nested=True) as own:  # the rank's own run
        mlflow.log_metric("own", 7.0, step=3)
    mlflow.log_metric("explicit", 1.0, synchronous=True)  # MLflow's path, into the shared run
    ops = mlflow.log_metric("async", 2.0 + int(rank), synchronous=False)
    ops.wait()  # what MLflow returns for an asynchronous call, already done
    try:
        mlflow.log_metric("bad", "not a number")
    except MlflowException as exc:
        refused = str(exc)
    else:
        refused = ""
    return shared, own.info.run_id, refused


def test_other_runs_sync_calls_and_invalid_values_behave_as_in_mlflow(store):
    results = distributed(num_accelerators=2, display="none")(_other_paths).distributed()
    run_id = last_run_id()
    for shared, own, refused in results:
        assert shared == run_id and own != run_id
        assert [(m.step, m.value) for m in store.get_metric_history(own, "own")] == [(3, 7.0)]
        assert "not a number" in refused and "valid double" in refused
    metrics = store.get_run(run_id).data.metrics
    assert metrics["explicit"] == 1.0 and metrics["async"] in (2.0, 3.0) and "own" not in metrics
    assert len(store.get_metric_history(run_id, "async")) == 2  # one per rank


def test_a_file_store_gets_the_batched_metrics_too(store, tmp_path, monkeypatch):
    uri = (tmp_path / "mlruns").as_uri()  # MLflow's file store: file:///...
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3.17 refuses file stores otherwise
    assert distributed(num_accelerators=2, display="none")(_log_steps).distributed(50) == [True, True]
    client = MlflowClient(uri)
    history = client.get_metric_history(last_run_id(), "rank1/value")
    assert [(m.step, m.value) for m in history] == [(s, s * 2.5) for s in range(50)]
    assert client.get_run(last_run_id()).info.status == "FINISHED"


def _log_then_raise(steps):
    import os

    import mlflow

    if os.environ["RANK"] != "0":
        return 1  # (a rank still importing mlflow when rank 0 fails would be stopped before logging)
    for step in range(steps):
        # The user's own timestamps (ms) travel as given.
        mlflow.log_metric("rank0", step, step=step, timestamp=1_700_000_000_000 + step)
    raise ValueError("rank 0 gave up after logging")


@pytest.mark.fault("a rank raises after logging metrics", "every metric it logged is in the run")
def test_a_raising_rank_keeps_its_metrics_with_the_users_timestamps(store):
    with pytest.raises(ValueError, match="rank 0 gave up"):
        distributed(num_accelerators=2, display="none")(_log_then_raise).distributed(100)
    history = store.get_metric_history(last_run_id(), "rank0")
    assert [(m.step, m.value, m.timestamp) for m in history] == [
        (s, float(s), 1_700_000_000_000 + s) for s in range(100)
    ]


def test_the_writer_takes_only_complete_lines(store, tmp_path):
    """A line caught half-written is left for the next pass, then written whole."""
    from air_magic.tracking.metric_writer import MetricWriter

    experiment = store.create_experiment("writer", artifact_location=(tmp_path / "a").as_uri())
    run_id = store.create_run(experiment).info.run_id
    folder = tmp_path / "metrics"
    folder.mkdir()
    lines = folder / "rank-0.tsv"
    lines.write_text("loss\t0.5\t1700000000000\t0\nloss\t0.2")
    writer = MetricWriter(store, run_id, str(folder))
    assert writer.write_pass() and writer.written == 1
    with lines.open("a") as f:
        f.write("5\t1700000000001\t1\n")
    assert writer.write_pass() and writer.written == 2
    writer.close()
    assert [(m.step, m.value) for m in store.get_metric_history(run_id, "loss")] == [(0, 0.5), (1, 0.25)]


def test_batched_when_the_warm_starter_preloaded_mlflow(store, monkeypatch):
    monkeypatch.setenv("AIR_MAGIC_PRELOAD", "torch,mlflow")  # a new starter, with mlflow imported
    assert distributed(num_accelerators=2, display="none")(_log_steps).distributed(5) == [True, True]
    assert len(store.get_metric_history(last_run_id(), "loss")) == 10


def test_a_store_that_refuses_rows_holds_few_in_memory_and_gets_them_all_later(store, tmp_path, monkeypatch):
    """While the store refuses (a full disk), at most MAX_PENDING rows wait in memory, the rest in
    the files; once it takes them again, every row is written, none twice."""
    from air_magic.tracking import metric_writer
    from air_magic.tracking.metric_writer import MetricWriter

    monkeypatch.setattr(metric_writer, "MAX_PENDING", 1000)
    monkeypatch.setattr(metric_writer, "READ_BYTES", 4096)
    experiment = store.create_experiment("refused", artifact_location=(tmp_path / "a").as_uri())
    run_id = store.create_run(experiment).info.run_id
    folder = tmp_path / "metrics"
    folder.mkdir()
    for rank in range(2):
        rows = "".join(f"loss_{rank}\t{step}\t{1700000000000 + step}\t{step}\n" for step in range(5000))
        (folder / f"rank-{rank}.tsv").write_text(rows)

    class Refusing:
        batch = 500

        def __init__(self):
            self.refuse, self.written = True, []

        def write(self, rows):
            if self.refuse:
                raise OSError(28, "database or disk is full\n[SQL: INSERT ...]")
            self.written.extend(rows)

    sink = Refusing()
    writer = MetricWriter(store, run_id, str(folder), sink=sink)
    for _ in range(5):
        assert not writer.write_pass()
        assert len(writer._pending) <= 1000 + 4096 // 10, len(writer._pending)  # one read past the cap
    assert writer.last_error == "OSError: [Errno 28] database or disk is full"
    assert writer.close() == 10_000  # every row not stored is counted: in memory and in the files
    sink.refuse = False
    assert writer.close() == 0
    assert len(sink.written) == 10_000 and len(set(sink.written)) == 10_000
