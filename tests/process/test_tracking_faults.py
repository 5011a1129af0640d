"""Fault matrix cases of MLflow tracking in the caller: interrupts, unreachable servers, first use at once.

Each case runs real caller processes (tests/helpers) against a real store: a
fresh embedded sqlite store, or a loopback address where nothing answers. The
interrupts are real SIGINTs, sent at chosen moments of a call.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from helpers.paths import HELPERS

mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402

fault = pytest.mark.fault


def _caller_env(**extra: str) -> dict[str, str]:
    """This process's environment for a caller, without the MLflow settings an earlier test left.

    ``mlflow.set_tracking_uri`` and ``set_experiment`` also write ``MLFLOW_TRACKING_URI`` and
    ``MLFLOW_EXPERIMENT_ID`` into ``os.environ``; a caller inheriting them would track elsewhere.
    """
    kept = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    return {**kept, "MLFLOW_DISABLE_TELEMETRY": "true", **extra}


def _run_helper(script: str, *args: str, timeout: float = 180) -> dict:
    """Run a helper caller to its end; return the JSON of its last line of output."""
    done = subprocess.run(
        [sys.executable, str(HELPERS / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_caller_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _statuses(experiment: str) -> list[str]:

    from air_magic import paths

    client = MlflowClient(paths.embedded_mlflow_uri())
    found = client.get_experiment_by_name(experiment)
    assert found is not None
    return [r.info.status for r in client.search_runs([found.experiment_id])]


@pytest.mark.serial  # SIGINTs that must land inside `import mlflow`
@fault(
    "Ctrl-C during the process's first tracked call, while mlflow is being imported",
    "KeyboardInterrupt; the next call works and is tracked; no run left RUNNING",
)
def test_an_interrupt_during_the_first_import_of_mlflow_breaks_no_later_call(store):
    landed = []
    # Importing mlflow takes 1.5 s or more here: before the import starts, and well within it.
    for delay in ("0.05", "0.6"):
        report = _run_helper("early_interrupt_caller.py", delay)
        assert report["outcomes"] == ["interrupted"], (delay, report)
        assert report["error"] is None, (delay, report)
        assert report["results"] == [0, 1] and report["last_run"], (delay, report)
        assert report["running"] == [], (delay, report)
        landed += report["landed"]
    assert "while mlflow was being imported" in landed, landed  # the case was really met
    assert set(_statuses("early-interrupt")) <= {"FINISHED", "KILLED"}


@pytest.mark.serial  # SIGINTs 0-120 ms into a call
@fault(
    "Ctrl-C in the first 100 ms of a tracked call (the run being created)",
    "KeyboardInterrupt; the run ends KILLED at once (or is never made); the next call is tracked",
)
def test_an_interrupt_while_the_run_is_created_leaves_no_run_running(store):
    delays = ["never", "0", "0.005", "0.01", "0.02", "0.03", "0.04", "0.06", "0.08", "0.12"]
    report = _run_helper("early_interrupt_caller.py", *delays)
    assert report["outcomes"][0] == "finished" and "interrupted" in report["outcomes"], report
    assert report["error"] is None and report["results"] == [0, 1] and report["last_run"], report
    assert report["running"] == [], report  # checked in the caller, before its exit could end them
    statuses = _statuses("early-interrupt")
    assert set(statuses) <= {"FINISHED", "KILLED"} and statuses.count("FINISHED") >= 2, statuses


@pytest.fixture
def black_hole() -> Iterator[int]:
    """A loopback port that accepts connections (the kernel's backlog) but never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


def _closed_port() -> int:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now: a connection is refused at once
    return port


UNTRACKED_CALLS = (
    "from air_magic import distributed\n"
    "import air_magic\n"
    "f = distributed(num_accelerators=2, display='none', timeout=30, warm_start=False)(lambda: 7)\n"
    "print(f.distributed(), f.distributed(), air_magic.last_run().mlflow_run_id)\n"
)


@fault(
    "MLFLOW_TRACKING_URI points at a server that refuses connections, or accepts and never answers",
    "one loud line per call, the call runs untracked within seconds (not MLflow's minutes of retries)",
)
@pytest.mark.parametrize("server", ["refusing", "black hole"])
def test_an_unreachable_tracking_server_costs_seconds_and_the_call_runs_untracked(
    server, black_hole, tmp_path
):
    port = black_hole if server == "black hole" else _closed_port()
    uri = f"http://127.0.0.1:{port}"
    env = _caller_env(MLFLOW_TRACKING_URI=uri, AIR_MAGIC_MLFLOW_DIR=str(tmp_path / "m"))
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-c", UNTRACKED_CALLS], capture_output=True, text=True, timeout=90, env=env
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"two calls with an unreachable {uri} took more than 90 s")
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[7, 7] [7, 7] None"
    warnings = [line for line in done.stderr.splitlines() if "runs UNTRACKED" in line]
    assert len(warnings) == 2 and all(uri in line for line in warnings), done.stderr[-3000:]
    assert "rank logs are kept under" in warnings[0]
    assert took < 60, took


@fault(
    "four processes make their first tracked call at once on a fresh embedded store",
    "all succeed, each with its run (the store's tables are made once)",
)
def test_processes_opening_a_fresh_embedded_store_at_once_all_succeed(tmp_path):
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = _caller_env(AIR_MAGIC_MLFLOW_DIR=str(tmp_path / "fresh"))
    callers = [
        subprocess.Popen(
            [sys.executable, str(HELPERS / "first_use_caller.py"), str(barrier), "4"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(4)
    ]
    outputs = [caller.communicate(timeout=180) for caller in callers]
    failed = [err[-3000:] for c, (_, err) in zip(callers, outputs, strict=True) if c.returncode != 0]
    assert not failed, failed
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert [r["results"] for r in reports] == [[42]] * 4
    client = MlflowClient("sqlite:///" + str(tmp_path / "fresh" / "mlflow.db"))
    for report in reports:
        assert client.get_run(report["run"]).info.status == "FINISHED"
