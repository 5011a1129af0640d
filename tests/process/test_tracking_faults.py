"""Fault matrix cases of MLflow tracking in the caller: interrupts, unreachable servers, first use at once.

Each case runs real caller processes (tests/helpers) against a real store: a
fresh embedded sqlite store, or a loopback address where nothing answers. The
interrupts are real SIGINTs, sent at chosen moments of a call.
"""

from __future__ import annotations

import http
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

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


def _run_code(code: str, env: dict[str, str], cwd, timeout: float) -> subprocess.CompletedProcess:
    """A caller running ``code`` (python -c) in ``cwd``, to its end."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
    )


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


RANKS_LOG_METRICS = (
    "import os, time\n"
    "from air_magic import distributed\n"
    "def train():\n"
    "    import threading\n"
    "    import mlflow\n"
    "    mlflow.log_metric('loss', 0.5)\n"
    "    failed = []\n"  # MLflow from another thread (a callback's, async logging): same store
    "    def other():\n"
    "        try:\n"
    "            mlflow.log_metric('loss', 0.25)\n"
    "        except Exception as exc:\n"
    "            failed.append(repr(exc))\n"
    "    t = threading.Thread(target=other)\n"
    "    t.start(); t.join()\n"
    "    assert not failed, failed\n"
    "    uri = os.environ['MLFLOW_TRACKING_URI']\n"
    "    return uri.startswith('sqlite:///' + os.environ['AIR_MAGIC_RUN_DIR'] + '/untracked-mlflow-')\n"
    "f = distributed(num_accelerators=2, display='none', timeout=40, warm_start=False)(train)\n"
    "started = time.monotonic()\n"
    "print(f.distributed(), round(time.monotonic() - started, 2))\n"
)


@fault(
    "the ranks of a call that runs untracked (server down) call mlflow.log_metric themselves",
    "their MLflow calls go to a throwaway store in each rank's call folder, said in the one untracked "
    "line; no wait on the server",
)
def test_the_ranks_of_an_untracked_call_do_not_wait_on_the_server_that_was_down(tmp_path):
    uri = f"http://127.0.0.1:{_closed_port()}"
    env = _caller_env(MLFLOW_TRACKING_URI=uri, AIR_MAGIC_MLFLOW_DIR=str(tmp_path / "m"))
    try:
        done = _run_code(RANKS_LOG_METRICS, env, tmp_path, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the ranks' mlflow.log_metric waited on the refusing server")
    assert done.returncode == 0, done.stderr[-3000:]  # before: a timeout, the ranks in MLflow's retries
    values, took = done.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    assert values == "[True, True]", done.stderr[-3000:]
    assert float(took) < 30, took
    warnings = [line for line in done.stderr.splitlines() if "runs UNTRACKED" in line]
    assert len(warnings) == 1 and uri in warnings[0], done.stderr[-3000:]
    assert "the ranks' own MLflow calls go to a throwaway store in each rank's call folder" in warnings[0]
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "mlflow.db").exists()


class _NotMlflow(http.server.BaseHTTPRequestHandler):
    """Another web app's port, or a proxy for hosts it cannot reach: every request gets an HTML error."""

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status = self.server.status  # type: ignore[attr-defined]
        body = f"<html><body><h1>{status} {http.HTTPStatus(status).phrase}</h1></body></html>".encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def not_mlflow(request: pytest.FixtureRequest) -> Iterator[str]:
    """``http://127.0.0.1:<port>`` of a loopback web server that answers every request with
    ``request.param`` (an HTTP status) and an HTML page."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotMlflow)
    server.status = request.param  # type: ignore[attr-defined]
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


TIMED_UNTRACKED_CALLS = (
    "import time\n"
    "from air_magic import distributed\n"
    "import air_magic\n"
    "f = distributed(num_accelerators=2, display='none', timeout=30, warm_start=False)(lambda: 7)\n"
    "for _ in range(2):\n"
    "    started = time.monotonic()\n"
    "    print(f.distributed(), air_magic.last_run().mlflow_run_id, round(time.monotonic() - started, 2))\n"
)


@fault(
    "MLFLOW_TRACKING_URI answers HTTP but is not MLflow (another web app: 404 pages; a proxy: 502)",
    "one loud line per call, the call runs untracked within the 5 s bound (no MlflowException, no retries)",
)
@pytest.mark.parametrize("not_mlflow", [404, 502], indirect=True)
def test_a_tracking_uri_that_is_not_mlflow_runs_the_call_untracked_within_the_bound(not_mlflow, tmp_path):
    from air_magic.tracking import remote

    env = _caller_env(MLFLOW_TRACKING_URI=not_mlflow, AIR_MAGIC_MLFLOW_DIR=str(tmp_path / "m"))
    done = _run_code(TIMED_UNTRACKED_CALLS, env, tmp_path, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]  # before (404): MlflowException, exit 1
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()[-2:]
    assert [line.rsplit(" ", 1)[0] for line in lines] == ["[7, 7] None"] * 2, done.stdout
    # The set-up's bound, plus the call itself (two fresh ranks; the first call imports mlflow).
    took = [float(line.rsplit(" ", 1)[1]) for line in lines]
    assert max(took) < remote.REMOTE_CHECK_S + 10, took  # before (502): 30 s, MLflow's retries
    warnings = [line for line in done.stderr.splitlines() if "runs UNTRACKED" in line]
    assert len(warnings) == 2 and all(not_mlflow in line for line in warnings), done.stderr[-3000:]


@pytest.fixture
def read_only_mount(tmp_path: Path) -> Iterator[tuple[Path, Callable[[], None]]]:
    """A tmpfs (0700) to fill, and a function that remounts it read-only (chmod does not stop root)."""
    point = tmp_path / "mnt"
    point.mkdir()
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("no mount(8) here")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(point)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {made.stderr.decode(errors='replace')}")

    def make_read_only() -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True, capture_output=True)

    try:
        yield point, make_read_only
    finally:
        if subprocess.run(["umount", str(point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(point)], capture_output=True)


def test_open_private_reads_a_private_file_in_a_read_only_folder(read_only_mount):
    from air_magic import private_files

    point, make_read_only = read_only_mount
    path = point / "mlflow.db"
    path.write_bytes(b"")
    path.chmod(0o600)
    make_read_only()
    private_files.create_private_file(str(path))  # before: fchmod on a read-only file system, EROFS
    fd = private_files.open_private(str(path), os.O_RDONLY)
    os.close(fd)


@fault(
    "the embedded store's folder (AIR_MAGIC_MLFLOW_DIR) is read-only",
    "one loud line naming the folder and AIR_MAGIC_MLFLOW_DIR; the call runs untracked",
)
def test_a_read_only_embedded_store_runs_the_call_untracked_and_names_the_folder(
    read_only_mount, new_store, tmp_path
):
    point, make_read_only = read_only_mount
    folder = new_store(point / "store")  # a store as MLflow leaves a new one, 0600 in 0700
    make_read_only()
    env = _caller_env(AIR_MAGIC_MLFLOW_DIR=folder)
    done = _run_code(UNTRACKED_CALLS, env, tmp_path, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]  # before: a bare OSError [Errno 30], no path
    assert done.stdout.strip().splitlines()[-1] == "[7, 7] [7, 7] None"
    warnings = [line for line in done.stderr.splitlines() if "runs UNTRACKED" in line]
    assert len(warnings) == 2, done.stderr[-3000:]
    assert all(folder in line and "AIR_MAGIC_MLFLOW_DIR" in line for line in warnings), warnings
    assert "is read-only" in warnings[0]
