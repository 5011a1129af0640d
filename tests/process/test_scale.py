"""The caller at scale (issue 34): 1,000 synthetic ranks through the real caller, a failure and a lost node.

``benchmarks/synthetic_ranks.py`` plays the ranks in two generator processes and sends their
output as node facts through the product's call loop, ledger, output router, display and metric
writer into the embedded MLflow store (its docstring says what is real). Here it runs small and
short; the measured runs are in docs/benchmarks.md ("At scale"). Times are reported there, not
asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers.modules import skip_unless_installed

pytestmark = skip_unless_installed("mlflow", "ipywidgets", "psutil")
fault = pytest.mark.fault
HARNESS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "synthetic_ranks.py")


def _harness(tmp_path, *args: str) -> dict:
    env = dict(
        os.environ,
        AIR_MAGIC_MLFLOW_DIR=str(tmp_path / "mlflow"),
        AIR_MAGIC_LOG_DIR=str(tmp_path / "logs"),
        AIR_MAGIC_MLFLOW_UI="0",
    )
    done = subprocess.run(
        [sys.executable, HARNESS, *args], env=env, capture_output=True, text=True, timeout=100, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@fault(
    "a rank failing among 1,000 (synthetic ranks, 125 nodes)", "it is the root cause; every metric row stored"
)
@pytest.mark.timeout(120)
def test_a_rank_failing_among_a_thousand_is_the_root_cause_and_no_metric_row_is_lost(tmp_path):
    got = _harness(
        tmp_path,
        *("--ranks", "1000", "--seconds", "8", "--lines-per-s", "2", "--metrics-per-s", "2"),
        *("--bar-per-s", "1", "--burst-every-s", "1", "--burst-lines", "500", "--fail-rank", "737"),
        *("--fail-at", "2", "--display", "tabs"),
    )
    assert (got["outcome"], got["root_cause"]) == ("failed", 737), got
    assert got["error"].startswith("rank 737 of 1000 raised builtins.ValueError: rank 737 hit a bad batch")
    assert 737 in got["tabs_hold"] and got["tabs_hold"][0] == 0  # the view of many ranks shows it
    assert got["metric_rows_written"] > 0 and got["metric_rows_stored"] == got["metric_rows_written"]
    with open(os.path.join(got["log_dir"], "rank-737.log")) as f:
        log = f.read()
    assert "rank 737 step" in log and "ValueError: a bad batch" in log


@fault("a node lost among 25 (synthetic ranks)", "the node and its ranks named; every metric row stored")
@pytest.mark.timeout(120)
def test_a_node_lost_among_25_is_named_with_its_ranks(tmp_path):
    got = _harness(
        tmp_path,
        *("--ranks", "200", "--seconds", "8", "--lose-node", "7", "--lose-at", "2", "--display", "text"),
    )
    assert got["outcome"] == "failed" and got["root_cause"] in range(56, 64), got
    lost = "node 7 was lost during the call: its raylet died (synthetic), and rank(s) 56, 57, 58, 59, 60"
    assert got["error"].startswith(lost + ", 61, 62, 63 with it")
    assert got["metric_rows_written"] > 0 and got["metric_rows_stored"] == got["metric_rows_written"]


def _joins_gloo_prints_and_logs(steps: int, fail_rank: int):
    import os

    import mlflow
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    value = torch.ones(1)
    dist.all_reduce(value)
    for i in range(steps):
        print(f"rank {rank} step {i}")
        mlflow.log_metric(f"loss_rank{rank}", 1.0 / (i + 1), step=i)  # a key each: none deduplicated
    if rank == fail_rank:
        raise ValueError(f"rank {rank} hit a bad batch")
    dist.barrier()  # the others wait in a collective for the rank that raised
    dist.destroy_process_group()
    return int(value.item())


# What 2 cores cannot hold (256 ranks import torch and join gloo): run on the device host, whose 16
# cores are the machine, with AIR_MAGIC_FORCE_CPU=1 there (docs/gpu-validation.md).
@pytest.mark.serial
@pytest.mark.skipif((os.cpu_count() or 1) < 16, reason="256 real ranks need a 16-core host (the device)")
@pytest.mark.timeout(900)
def test_256_real_ranks_on_a_16_core_host_and_one_failing_among_them(monkeypatch):
    from helpers.procs import leftover_processes
    from helpers.ranks import mlflow_status, run_ranks
    from mlflow.tracking import MlflowClient

    import air_magic
    from air_magic.paths import embedded_mlflow_uri

    monkeypatch.setenv("AIR_MAGIC_FORCE_CPU", "1")
    world, steps = 256, 20
    assert run_ranks(_joins_gloo_prints_and_logs, steps, -1, n=world) == [world] * world
    info = air_magic.last_run()
    client = MlflowClient(embedded_mlflow_uri())
    assert (
        len(client.get_run(info.mlflow_run_id).data.metrics.keys() & {f"loss_rank{r}" for r in range(world)})
        == world
    )
    assert len(client.get_metric_history(info.mlflow_run_id, "loss_rank255")) == steps
    assert not leftover_processes()

    with pytest.raises(ValueError, match="rank 200 hit a bad batch") as failed:
        run_ranks(_joins_gloo_prints_and_logs, steps, 200, n=world)
    assert failed.value.air_magic_rank == 200  # not a peer's connection error from the barrier
    assert mlflow_status(air_magic.last_run()) == "FAILED"
    assert not leftover_processes()
