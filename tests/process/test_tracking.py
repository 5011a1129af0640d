"""MLflow: one run per call, every rank logging into it, a link to it (SPEC §9).

Against real stores: the embedded sqlite store, and a real ``mlflow server``
subprocess on 127.0.0.1 (an HTTP tracking URI).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

mlflow = pytest.importorskip("mlflow")
from helpers.ranks import interrupt_tracked_caller  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

import air_magic  # noqa: E402
from air_magic import distributed, paths  # noqa: E402
from air_magic.tracking import ui as mlflow_ui  # noqa: E402
from air_magic.tracking.store import default_experiment_name  # noqa: E402


def only_run(client, experiment=None):
    experiment = experiment or default_experiment_name()  # here: pytest's own name
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, [e.name for e in client.search_experiments()]
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, runs
    return runs[0]


def _log_from_every_rank(steps):
    import os

    import mlflow

    rank = int(os.environ["RANK"])
    shared = os.environ["MLFLOW_RUN_ID"]  # (mlflow.start_run() removes it from the environment)
    with mlflow.start_run():  # a user's own start/end (resumes the shared run) must not end it
        mlflow.log_param(f"rank{rank}_param", "yes")
    for step in range(steps):
        mlflow.log_metric("loss", 1.0 / (step + 1) + rank, step=step)
        mlflow.log_metric(f"rank{rank}_seen", step, step=step)
    mlflow.end_run()
    mlflow.log_metric(f"rank{rank}_after_end", 1.0)  # still lands in the shared run
    assert mlflow.active_run().info.run_id == shared
    return shared


def test_one_run_per_call_with_params_metrics_from_every_rank_and_logs(store):
    fn = distributed(num_accelerators=2, display="none")(_log_from_every_rank)
    run_ids = fn.distributed(3)
    run = only_run(store)
    assert run_ids == [run.info.run_id] * 2
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["world_size"] == "2" and params["backend"] == "gloo"
    assert params["function"] == "_log_from_every_rank" and params["timeout_s"] == "10800"
    assert params["air_magic_version"] == air_magic.__version__ and params["rank0_param"] == "yes"
    metrics = run.data.metrics
    for rank in (0, 1):
        assert metrics[f"rank{rank}_seen"] == 2 and metrics[f"rank{rank}_after_end"] == 1.0
        history = store.get_metric_history(run.info.run_id, f"rank{rank}_seen")
        assert [m.step for m in history] == [0, 1, 2]
    assert len(store.get_metric_history(run.info.run_id, "loss")) == 6  # both ranks, one key
    artifacts = {a.path for a in store.list_artifacts(run.info.run_id, "logs")}
    assert artifacts == {"logs/rank-0.log", "logs/rank-1.log", "logs/run.json"}
    (source_file,) = [a.path for a in store.list_artifacts(run.info.run_id, "source")]
    source = store.download_artifacts(run.info.run_id, source_file)
    assert "def _log_from_every_rank" in Path(source).read_text()
    assert run.data.tags["air_magic.outcome"] == "succeeded"
    # A second call is a second run.
    fn.distributed(1)
    exp = store.get_experiment_by_name(default_experiment_name())
    assert len(store.search_runs([exp.experiment_id])) == 2


def test_nested_under_the_notebooks_active_run(store, tmp_path):
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/user.db")
    mlflow.set_experiment("users-experiment")
    with mlflow.start_run() as parent:
        distributed(num_accelerators=2, display="none", run_name="child-call")(
            _log_from_every_rank
        ).distributed(1)
    user = MlflowClient(f"sqlite:///{tmp_path}/user.db")
    runs = user.search_runs([parent.info.experiment_id], filter_string="tags.mlflow.runName = 'child-call'")
    assert len(runs) == 1
    assert runs[0].data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert runs[0].info.status == "FINISHED"
    assert user.get_run(parent.info.run_id).info.status == "FINISHED"  # ended by the user, not by us
    assert store.search_runs([e.experiment_id for e in store.search_experiments()]) == []  # not ours


def _fail_on_rank_1():
    import os
    import time

    if os.environ["RANK"] == "1":
        raise RuntimeError("rank 1 broke")
    time.sleep(60)


def test_failed_on_a_rank_error_and_on_timeout(store):
    with pytest.raises(RuntimeError):
        distributed(num_accelerators=2, display="none", experiment="errors")(_fail_on_rank_1).distributed()
    run = only_run(store, "errors")
    assert run.info.status == "FAILED"
    assert run.data.tags["air_magic.failed_rank"] == "1"
    assert "rank 1 broke" in run.data.tags["air_magic.error"]
    with pytest.raises(air_magic.DistributedTimeoutError):
        distributed(num_accelerators=2, display="none", experiment="timeouts", timeout=2)(
            time.sleep
        ).distributed(60)
    run = only_run(store, "timeouts")
    assert run.info.status == "FAILED" and run.data.tags["air_magic.outcome"] == "timeout"


@pytest.mark.fault("an interrupted tracked call", "the MLflow run ends KILLED")
def test_killed_on_interrupt(store, tmp_path):
    out, err = interrupt_tracked_caller(tmp_path)
    assert "interrupted" in out, err
    run = only_run(store, "interrupted")
    assert run.info.status == "KILLED" and run.data.tags["air_magic.outcome"] == "interrupted"


def test_tracking_off_creates_no_run(store):
    assert distributed(num_accelerators=2, display="none", tracking=False)(_quiet).distributed() == [1, 1]
    experiments = [e.experiment_id for e in store.search_experiments()]
    assert store.search_runs(experiments) == []
    assert air_magic.last_run().tracking is None


def _quiet():
    return 1


def test_without_mlflow_installed_calls_run_untracked_with_one_note(tmp_path):
    blocker = tmp_path / "blocked" / "mlflow"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('mlflow is blocked for this test')\n")
    script = (
        "from air_magic import distributed\n"
        "f = distributed(num_accelerators=2, display='none')(lambda: 5)\n"
        "print(f.distributed(), f.distributed())\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "blocked"), AIR_MAGIC_MLFLOW_DIR=str(tmp_path / "m"))
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "[5, 5] [5, 5]" in done.stdout
    assert done.stderr.count("MLflow is not installed") == 1


def test_a_started_ui_serves_the_embedded_store_and_works_as_an_http_tracking_server(store, monkeypatch):
    try:
        base = mlflow_ui.ensure_ui(paths.embedded_mlflow_uri())  # a real `mlflow server` on 127.0.0.1
        assert base.startswith("http://127.0.0.1:")
        # 1. The embedded store: once the UI runs, a call's link points at it, and it opens.
        distributed(num_accelerators=2, display="none")(_quiet).distributed()
        url = air_magic.last_run().tracking_url
        assert url is not None and url.startswith(base + "/#/experiments/")
        with urllib.request.urlopen(url, timeout=10) as page:
            assert page.status == 200
        # The line magic finds the same server rather than starting another.
        from helpers.kernel import air_magic_shell
        from IPython.utils.capture import capture_output

        with air_magic_shell() as ip, capture_output() as shown:
            ip.run_line_magic("distributed", "mlflow-ui")
        assert f"MLflow UI: {base}" in shown.stdout
        # 2. An HTTP tracking URI: the user's configuration wins; ranks log through the server.
        monkeypatch.setenv("MLFLOW_TRACKING_URI", base)
        distributed(num_accelerators=2, display="none", experiment="over-http")(
            _log_from_every_rank
        ).distributed(2)
        info = air_magic.last_run()
        assert info.tracking_url and info.tracking_url.startswith(base + "/#/experiments/")
        run_id = info.tracking_url.rsplit("/", 1)[1]
        with urllib.request.urlopen(f"{base}/api/2.0/mlflow/runs/get?run_id={run_id}", timeout=10) as api:
            assert api.status == 200 and b'"FINISHED"' in api.read()
        run = MlflowClient(base).get_run(run_id)
        assert run.data.metrics["rank1_seen"] == 1 and run.data.metrics["rank0_after_end"] == 1.0
    finally:
        mlflow_ui.stop_ui(paths.embedded_mlflow_uri())


def test_the_cell_magic_names_experiment_and_run_and_can_turn_tracking_off(store, ip):
    from IPython.utils.capture import capture_output

    with capture_output():
        ip.run_cell_magic(
            "distributed", "-n 2 --display none --experiment cells --run-name my-cell", "x = 1\n"
        )
        ip.run_cell_magic("distributed", "-n 2 --display none --experiment cells --no-tracking", "x = 2\n")
    run = only_run(store, "cells")
    assert run.data.tags["mlflow.runName"] == "my-cell" and run.data.tags["air_magic.kind"] == "cell"
    (source_file,) = [a.path for a in store.list_artifacts(run.info.run_id, "source")]
    assert Path(store.download_artifacts(run.info.run_id, source_file)).read_text() == "x = 1\n"


def _named_run_in_each_rank():
    import os
    import warnings

    import mlflow

    rank = int(os.environ["RANK"])
    shared = os.environ["MLFLOW_RUN_ID"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mlflow.start_run(run_id=shared, run_name="renamed-by-a-rank"):  # resumes, keeps its name
            pass
    with mlflow.start_run(run_name=f"rank-{rank}") as child:  # as under torchrun: the rank's own run
        mlflow.log_metric("rank_loss", float(rank))
        with mlflow.start_run(run_name=f"rank-{rank}-inner", nested=True) as grandchild:
            pass
    mlflow.log_metric(f"rank{rank}_after", 1.0)  # the child ended: this lands in the shared run again
    return child.info.run_id, grandchild.info.run_id, [str(w.message) for w in caught]


@pytest.mark.fault(
    "every rank calls mlflow.start_run(run_name=f'rank-{RANK}'), as code written for torchrun does",
    "one child run per rank under the call's run, which keeps its name",
)
def test_a_named_start_run_in_each_rank_makes_a_child_run_and_never_renames_the_shared_one(store):
    results = distributed(num_accelerators=2, display="none", experiment="named")(
        _named_run_in_each_rank
    ).distributed()
    shared = air_magic.last_run().mlflow_run_id
    run = store.get_run(shared)
    assert run.info.run_name == "_named_run_in_each_rank" and run.info.status == "FINISHED"
    assert run.data.metrics["rank0_after"] == 1.0 and run.data.metrics["rank1_after"] == 1.0
    for rank, (child_id, grandchild_id, warned) in enumerate(results):
        child = store.get_run(child_id)
        assert child.info.run_name == f"rank-{rank}" and child.info.status == "FINISHED"
        assert child.data.tags["mlflow.parentRunId"] == shared
        assert child.info.experiment_id == run.info.experiment_id
        assert child.data.metrics == {"rank_loss": float(rank)}
        grandchild = store.get_run(grandchild_id)
        assert grandchild.data.tags["mlflow.parentRunId"] == child_id
        assert any("keeps its name" in w for w in warned), warned


def _own_experiment_in_each_rank():
    import os

    import mlflow

    mlflow.set_experiment("chosen-in-the-rank")
    with mlflow.start_run() as run:
        mlflow.log_param("rank", os.environ["RANK"])
    return run.info.run_id


@pytest.mark.fault(
    "a rank calls mlflow.set_experiment() then mlflow.start_run(), as under torchrun",
    "no MLflow error; the rank's run is in that experiment, a child of the call's run",
)
def test_set_experiment_then_start_run_in_a_rank_works_as_under_torchrun(store):
    run_ids = distributed(num_accelerators=2, display="none", experiment="calls")(
        _own_experiment_in_each_rank
    ).distributed()
    shared = only_run(store, "calls")
    assert shared.info.status == "FINISHED" and shared.info.run_name == "_own_experiment_in_each_rank"
    chosen = store.get_experiment_by_name("chosen-in-the-rank")
    assert chosen is not None
    runs = {r.info.run_id: r for r in store.search_runs([chosen.experiment_id])}
    assert sorted(runs) == sorted(run_ids) and len(set(run_ids)) == 2
    for rank, run_id in enumerate(run_ids):
        assert runs[run_id].data.params == {"rank": str(rank)}
        assert runs[run_id].data.tags["mlflow.parentRunId"] == shared.info.run_id
        assert runs[run_id].info.status == "FINISHED"


def _set_experiment_that_a_peer_created_in_between():
    """MLflow's race, made certain: the look-up misses, then another rank's experiment is there."""
    import os

    import mlflow
    from mlflow.tracking import MlflowClient
    from mlflow.tracking._tracking_service.client import TrackingServiceClient

    name = f"raced-{os.environ['RANK']}"
    made = MlflowClient().create_experiment(name)  # "the other rank", a moment earlier
    look_up = TrackingServiceClient.get_experiment_by_name
    missed = []

    def first_look_misses(self, experiment_name):
        if experiment_name == name and not missed:
            missed.append(True)
            return None
        return look_up(self, experiment_name)

    TrackingServiceClient.get_experiment_by_name = first_look_misses
    try:
        mlflow.set_experiment(name)
    finally:
        TrackingServiceClient.get_experiment_by_name = look_up
    with mlflow.start_run() as run:
        pass
    return missed == [True], made, run.info.experiment_id


@pytest.mark.fault(
    "every rank calls mlflow.set_experiment('x') at once and another rank creates 'x' in between",
    "the experiment is active in every rank (MLflow returns it without activating it in that race)",
)
def test_set_experiment_takes_effect_when_a_peer_created_it_in_between(store):
    results = distributed(num_accelerators=2, display="none", experiment="raced")(
        _set_experiment_that_a_peer_created_in_between
    ).distributed()
    for raced, made, used in results:
        assert raced  # the race happened, as staged
        assert used == made  # and the rank's run is in the experiment it set


def _open_a_child_run_then_die(barrier):
    import os
    import time

    import mlflow

    rank = os.environ["RANK"]
    mlflow.start_run(run_name=f"rank-{rank}")  # never ended: the rank dies first
    open(os.path.join(barrier, rank), "w").close()
    if rank == "1":
        while len(os.listdir(barrier)) < 2:  # both child runs exist
            time.sleep(0.01)
        os._exit(3)
    time.sleep(60)  # killed by the launcher once rank 1 has failed


@pytest.mark.fault(
    "ranks die with their own child MLflow run still open",
    "the child runs end with the call's status, not RUNNING",
)
def test_child_runs_of_ranks_that_died_end_with_the_call(store, tmp_path):
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    with pytest.raises(air_magic.RankFailedError):
        distributed(num_accelerators=2, display="none", experiment="dying", timeout=60)(
            _open_a_child_run_then_die
        ).distributed(str(barrier))
    shared = store.get_run(air_magic.last_run().mlflow_run_id)
    children = store.search_runs(
        [shared.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{shared.info.run_id}'"
    )
    assert sorted(c.info.run_name for c in children) == ["rank-0", "rank-1"]
    assert [c.info.status for c in children] == ["FAILED", "FAILED"]
    assert shared.info.status == "FAILED"
