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
