"""Shared fixtures: every test must leave no process, run directory or stray log behind.

The test process makes itself a *child subreaper* (prctl), so any process a
rank leaves behind (even one whose parent died) is re-parented to pytest and
shows up in ``psutil.Process().children(recursive=True)``. After each test we
wait up to 5 s for all of them to be gone; a leftover fails the test.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

PR_SET_CHILD_SUBREAPER = 36
LEFTOVER_WAIT_S = 5.0


def pytest_configure(config: pytest.Config) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _on_the_ray_cluster(item: pytest.Item) -> bool:
    if "ray_cluster" in getattr(item, "fixturenames", ()):
        return True
    callspec = getattr(item, "callspec", None)  # the contract suite's Ray backends ask for it late
    return callspec is not None and str(callspec.params.get("backend", "")).startswith("ray")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests on the Ray cluster run last, in their files' order: one cluster serves them all.

    Starting it takes 20 s; once up, its processes would be running beside every other test."""
    items.sort(key=_on_the_ray_cluster)  # stable: False (the rest) first, each part in its order


# Every test of these files is slow (an MLflow store or server, or a subprocess first importing
# MLflow: 1-30 s a test); their own tests carry no marker. Other slow tests are marked where they
# are written (@pytest.mark.slow, or pytestmark for a whole file).
@pytest.fixture(scope="session", autouse=True)
def _private_dirs(tmp_path_factory: pytest.TempPathFactory):
    """Logs, run directories and the MLflow store of the session go to folders we can inspect."""
    logs = tmp_path_factory.mktemp("logs")
    runs = tmp_path_factory.mktemp("tmp")
    old_log, old_tmp = os.environ.get("AIR_MAGIC_LOG_DIR"), tempfile.tempdir
    os.environ["AIR_MAGIC_LOG_DIR"] = str(logs)
    # MLflow: the embedded store in the session's folder; no telemetry file under $HOME.
    os.environ["AIR_MAGIC_MLFLOW_DIR"] = str(tmp_path_factory.mktemp("mlflow"))
    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    # A call in a kernel starts the store's MLflow UI server, which outlives the kernel: tests of
    # it (test_mlflow_ui.py, the browser's link test) turn it back on and stop it; others leave
    # the 2 cores to the ranks.
    os.environ["AIR_MAGIC_MLFLOW_UI"] = "0"
    # Detached runs' folders (and anything else under the state folder) of the session.
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    tempfile.tempdir = str(runs)
    yield
    tempfile.tempdir = old_tmp
    if old_log is None:
        os.environ.pop("AIR_MAGIC_LOG_DIR", None)
    else:
        os.environ["AIR_MAGIC_LOG_DIR"] = old_log


def _reap_zombies() -> None:
    for child in psutil.Process().children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(child.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError):
            pass


def leftover_processes(timeout: float = LEFTOVER_WAIT_S) -> list[psutil.Process]:
    """Descendants still alive after ``timeout`` seconds (zombies are reaped as we go).

    The warm starter of this process is meant to stay (it is a cache); what it started is not.
    """
    from air_magic.backends.local import warm

    deadline = time.monotonic() + timeout
    while True:
        _reap_zombies()
        alive = []
        keep = warm.starter_pid()
        for proc in psutil.Process().children(recursive=True):
            if proc.pid == keep or _rays_own(proc):
                continue
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.Error:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


# A Ray cluster of the tests (the ray_cluster fixture) is pytest's child and stays for the session:
# its processes, and the warm starters of its node agents, are not leftovers. Ranks are.
_RAY_MARKS = (
    "raylet",
    "gcs_server",
    "ray::",
    "ray/_private",
    "ray/dashboard",
    "ray/autoscaler",
    "default_worker.py",
)


def _rays_own(proc: psutil.Process) -> bool:
    try:
        line = " ".join(proc.cmdline())
        if proc.name().startswith("ray::") or any(mark in line for mark in _RAY_MARKS):
            return True
        if "starter_main" in line:  # a node agent's warm starter; a rank forked from it is not Ray's
            parent = proc.parent()
            return (
                parent is not None and _rays_own(parent) and "starter_main" not in " ".join(parent.cmdline())
            )
    except psutil.Error:
        return True  # gone meanwhile
    return False


@pytest.fixture(autouse=True)
def no_leftovers():
    """After each test: no descendant process alive, no run directory left in the temp dir."""
    yield
    alive = leftover_processes()
    described = []
    for proc in alive:
        try:
            described.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
        except psutil.Error:
            pass
        try:
            proc.kill()
        except psutil.Error:
            pass
    assert not described, f"processes left behind: {described}"
    stray = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("air_magic-")]
    assert not stray, f"run directories left behind: {stray}"


@pytest.fixture
def ip():
    """IPython's shell with ``%load_ext air_magic`` (tests/helpers/kernel.air_magic_shell)."""
    from helpers.kernel import air_magic_shell

    with air_magic_shell() as shell:
        yield shell


@pytest.fixture
def starter():
    """A new, ready warm starter for this process."""
    from air_magic import restart_warm_start
    from air_magic.backends.local import warm

    restart_warm_start()
    found = warm.get_starter(wait_s=120)
    assert found is not None, "the warm starter did not come up"
    return found


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A fresh embedded MLflow store, and no MLflow configuration left over from another test."""
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from mlflow.tracking._tracking_service import utils as tracking_utils

    monkeypatch.chdir(tmp_path)  # MLflow's own defaults (./mlruns) must not land in the repository
    monkeypatch.setenv("AIR_MAGIC_MLFLOW_DIR", str(tmp_path / "mlflow"))
    for name in (
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
        "MLFLOW_EXPERIMENT_ID",
        "MLFLOW_RUN_ID",
        "AIR_MAGIC_METRICS",
    ):
        # Set, then deleted: monkeypatch then removes at teardown what a test's MLflow calls
        # wrote here (mlflow.set_experiment() exports MLFLOW_EXPERIMENT_ID, say).
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(tracking_utils, "_tracking_uri", None)
    monkeypatch.setattr(mlflow.tracking.fluent, "_active_experiment_id", None)
    from air_magic import paths

    yield MlflowClient(paths.embedded_mlflow_uri())
    while mlflow.active_run():
        mlflow.end_run()


def gone_within(pids, seconds: float = 5.0) -> bool:
    """True once none of ``pids`` is a live process (zombies count as gone), within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.05)
    return False


def mlflow_status(info) -> str:
    """The MLflow status of a run's call, read back from the session's embedded store."""
    from mlflow.tracking import MlflowClient

    from air_magic.paths import embedded_mlflow_uri as embedded_uri

    assert info is not None and info.mlflow_run_id, "the call was not tracked"
    return MlflowClient(embedded_uri()).get_run(info.mlflow_run_id).info.status


def ready_starter() -> None:
    """Wait (up to 120 s) until the warm starter has imported torch, as a loaded machine may need.

    A call waits for the starter no longer than its own timeout, and then reports that no rank
    started: right for users, wrong for a test of what ranks do at a 3-second timeout."""
    from air_magic.backends.local import warm

    if warm.enabled():
        assert warm.get_starter(wait_s=120) is not None, "the warm starter did not come up"


def run_ranks(fn, *args, n=2, wait_for_starter=True, **settings):
    """Call ``fn`` on ``n`` ranks; when a launched call fails, its MLflow run must say FAILED."""
    import air_magic

    settings.setdefault("display", "none")
    if wait_for_starter and settings.get("timeout") is not None and settings.get("warm_start", True):
        ready_starter()  # a short timeout tests the ranks, not how long torch takes to import
    before = air_magic.last_run()
    try:
        return air_magic.distributed(num_accelerators=n, **settings)(fn).distributed(*args)
    except Exception:
        after = air_magic.last_run()
        if after is not before and after.mlflow_run_id:
            assert mlflow_status(after) == "FAILED"
        raise


def interrupt_tracked_caller(folder: Path, metrics_per_rank: int = 0) -> tuple[str, str]:
    """Run tests/helpers/tracked_caller.py (experiment 'interrupted'), SIGINT it once both ranks
    have logged ``metrics_per_rank`` metrics and are asleep; return its stdout and stderr."""
    ready = folder / "ready"
    ready.mkdir()
    script = os.path.join(os.path.dirname(__file__), "helpers", "tracked_caller.py")
    proc = subprocess.Popen(
        [sys.executable, script, str(ready), str(metrics_per_rank)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while len(os.listdir(ready)) < 2:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    return proc.communicate(timeout=60)


@pytest.fixture(scope="session")
def ray_cluster():
    """A real Ray cluster of 3 nodes on this machine, one fake GPU each (placement spreads ranks
    over nodes; the ranks run on the CPU with gloo, as no node has an NVIDIA driver). Loopback only.

    One for the whole run: the tests that use it run last (pytest_collection_modifyitems), as a
    connected driver holds sockets and Ray's processes are this process's children, which the
    other tests would count as theirs. A test that takes a node away puts one back."""
    # Before Ray is imported (it reads them then): every listener and address on 127.0.0.1 (NOTES.md).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray = pytest.importorskip("ray")
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    from air_magic.backends.ray import placement

    ray_constants.ENABLE_RAY_CLUSTER = False  # in case another test imported Ray first
    node = {"num_cpus": 2, "num_gpus": 1, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    cluster.node_args = node  # for tests that add a node back
    yield cluster
    placement.release_all(force=True)
    ray.shutdown()
    cluster.shutdown()
    deadline = time.monotonic() + 20
    while any(_rays_own(p) for p in psutil.Process().children(recursive=True)):
        if time.monotonic() > deadline:
            break  # the next test's leftover check names them
        _reap_zombies()
        time.sleep(0.1)
