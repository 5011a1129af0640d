"""Shared fixtures and the rules of every test: no process, call folder or stray log left behind.

Tests live in folders by kind (docs/testing.md): unit/ (no process of its own), process/ (real
rank and caller processes), kernel/ (a real IPython shell or Jupyter kernel), contract/ (the
backend contract, every backend), ray_cluster/ (a Ray cluster), browser/ (JupyterLab in chromium) and
gpu/ (the device). Each test gets its folder's name as a marker (``-m unit``).

The test process makes itself a *child subreaper* (prctl), so any process a
rank leaves behind (even one whose parent died) is re-parented to pytest and
shows up in ``psutil.Process().children(recursive=True)``. After each test we
wait up to 5 s for all of them to be gone; a leftover fails the test.
Shared helpers are modules in tests/helpers (``from helpers.procs import gone_within``).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

# Where PYTHONDONTWRITEBYTECODE is set (CI, this machine), every pytest process would rewrite and
# compile all 60 test modules again (4-7 s of CPU each: two xdist workers, then the serial part).
# Cached while pytest collects, in this process only (never in the ranks or kernels it starts);
# put back once collection is over (pytest_collection_finish below).
_DONT_WRITE_BYTECODE = sys.dont_write_bytecode
sys.dont_write_bytecode = False

pytest.register_assert_rewrite("helpers")  # their asserts say what they compared, as a test's do
from helpers.no_process import NO_PROCESS, refuse_process_starts  # noqa: E402
from helpers.paths import TESTS  # noqa: E402
from helpers.procs import leftover_processes, rays_own, reap_zombies  # noqa: E402

from air_magic import paths  # noqa: E402

PR_SET_CHILD_SUBREAPER = 36
# Each folder's marker. The Ray tests' folder is not named "ray": tests/ is on sys.path, and a folder
# named like a package stands in for it (as a namespace package) where the package is missing.
TIERS = {
    "unit": "unit",
    "process": "process",
    "kernel": "kernel",
    "contract": "contract",
    "ray_cluster": "ray",
    "browser": "browser",
    "gpu": "gpu",
}
# Tests that share machine-wide state run on one pytest-xdist worker, one after another
# (scripts/test.sh runs with --dist loadgroup): the Ray cluster of the session, and the MLflow UI
# server tests (one of them keeps another user's process alive, which turns every kernel's
# automatic UI start off) with the browser test that follows the UI link.
_UI_FILES = ("test_mlflow_ui.py", "test_browser.py")


def shared_worker_group(nodeid: str) -> str | None:
    """The group of tests that must run on one xdist worker that this test belongs to, from its id.

    From the id, not from marks: the scheduler (pytest_xdist_make_scheduler) sees only ids, and
    pytest-xdist's own loadgroup passes marks by appending "@group" to a test's id, which pytest
    9.2 ignores (pytest-xdist#1386: every group was silently spread over the workers, so each
    worker started a Ray cluster of its own)."""
    path = nodeid.split("::", 1)[0]
    if path.startswith("tests/ray_cluster/") or "[ray-" in nodeid:  # the contract's Ray backends
        return "ray"
    if Path(path).name in _UI_FILES:
        return "ui"
    return None


@pytest.hookimpl(optionalhook=True)  # pytest -p no:xdist: no such hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """--dist loadgroup with the groups of ``shared_worker_group``. xdist sends the biggest unit
    first (--loadscope-reorder): one worker starts on the Ray group, the other on the UI group."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class SharedWorkerGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return shared_worker_group(nodeid) or nodeid

    return SharedWorkerGroups(config, log)


def pytest_configure(config: pytest.Config) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _on_the_ray_cluster(item: pytest.Item) -> bool:
    if "ray_cluster" in getattr(item, "fixturenames", ()):
        return True
    callspec = getattr(item, "callspec", None)  # the contract suite's Ray backends ask for it late
    return callspec is not None and str(callspec.params.get("backend", "")).startswith("ray")


def tier_of(item: pytest.Item) -> str | None:
    """The kind of a test, from its folder under tests/ (None for a file at the top or elsewhere)."""
    try:
        parts = item.path.resolve().relative_to(TESTS).parts
    except ValueError:
        return None
    return TIERS.get(parts[0]) if len(parts) > 1 else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test is marked with its kind; the tests on the Ray cluster run last, in their files' order
    (in one process; under xdist their group goes to one worker first, see pytest_xdist_make_scheduler).

    One cluster serves them all: starting it takes 20 s; once up, its processes would be running
    beside every other test."""
    for item in items:
        tier = tier_of(item)
        if tier is not None:
            item.add_marker(tier)
        group = shared_worker_group(item.nodeid)
        if _on_the_ray_cluster(item) and group != "ray":
            raise pytest.UsageError(f"{item.nodeid} uses the Ray cluster: put it in tests/ray_cluster/")
        if group == "ray" and tier != "ray":  # also Ray of its own: /tmp/ray, its ports
            item.add_marker("ray")
    items.sort(key=_on_the_ray_cluster)  # stable: False (the rest) first, each part in its order


@pytest.fixture(scope="session", autouse=True)
def _private_dirs(tmp_path_factory: pytest.TempPathFactory):
    """Logs, run directories and the MLflow store of the session go to folders we can inspect.

    Each pytest-xdist worker is a session of its own, so workers share none of them."""
    logs = tmp_path_factory.mktemp("logs")
    runs = tmp_path_factory.mktemp("tmp")
    saved = {name: os.environ.get(name) for name in _SESSION_ENV}
    old_tmp = tempfile.tempdir
    os.environ["AIR_MAGIC_LOG_DIR"] = str(logs)
    # IPython's history database and profile, and Jupyter's connection files: the session's own.
    os.environ["IPYTHONDIR"] = str(tmp_path_factory.mktemp("ipython"))
    os.environ["JUPYTER_RUNTIME_DIR"] = str(tmp_path_factory.mktemp("jupyter-runtime"))
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
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


_SESSION_ENV = (
    "AIR_MAGIC_LOG_DIR",
    "AIR_MAGIC_MLFLOW_DIR",
    "MLFLOW_DISABLE_TELEMETRY",
    "AIR_MAGIC_MLFLOW_UI",
    "XDG_STATE_HOME",
    "IPYTHONDIR",
    "JUPYTER_RUNTIME_DIR",
)


def starts_no_process(item: pytest.Item) -> bool:
    """Marked unit: a test of tests/unit, or one of the contract suite's scripted row."""
    return item.get_closest_marker("unit") is not None


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """A unit test starts no process: each way to start one raises (helpers/no_process.py), and a
    test that swallowed the error fails at its end all the same. Not even the warm starter that
    ``%load_ext`` and ``.distributed()`` would start: it is turned off for them."""
    if not starts_no_process(request.node):
        yield None
        return
    from air_magic.protocol import env_names

    monkeypatch.setenv(env_names.WARM, "0")
    tried = refuse_process_starts(monkeypatch)
    yield tried  # what the test tried (tests/unit/test_no_process.py checks, then clears it)
    if tried:
        pytest.fail(f"{NO_PROCESS}; it tried: {', '.join(tried)}", pytrace=False)


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
    # A killed caller's metric folder that names its run is kept on purpose, for the run's import
    # at the next tracked call (tracking/metric_writer.import_left_behind): removed here, not a leak.
    from air_magic import paths, private_files

    for path in private_files.dead_callers_folders(paths.METRICS_KIND):
        if os.path.exists(os.path.join(path, paths.METRICS_RUN_FILE)):
            private_files.remove_tree(path)
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
    """A ready warm starter for this process: the running one while it is alive and current (a new
    one costs an import of torch; the tests that need one restart it themselves), else a new one."""
    from air_magic import restart_warm_start
    from air_magic.node import warm

    found = warm.get_starter(wait_s=120)
    # None: given up on earlier (a test of a starter that never gets ready), or another call waits
    # for it. A starter an earlier call still holds would outlive a restart the test asks for.
    if found is None or found.users:
        restart_warm_start()
        found = warm.get_starter(wait_s=120)
    assert found is not None, "the warm starter did not come up"
    return found


@pytest.fixture(scope="session")
def new_store(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], str]:
    """``new_store(folder)``: an embedded store in ``folder`` (made 0700) as MLflow leaves a new one.

    Making MLflow's tables (SQLAlchemy and Alembic's migrations) costs 2 s of CPU; they are made
    once a session and copied. Tests of a store MLflow has never opened use an empty folder."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    tables = tmp_path_factory.mktemp("store-tables")
    here = os.getcwd()
    os.chdir(tables)  # the Default experiment's artifact folder (./mlruns) stays in here
    try:
        MlflowClient(f"sqlite:///{tables / paths.MLFLOW_DB}").search_experiments()
    finally:
        os.chdir(here)

    def made(folder: Path) -> str:
        folder.mkdir(mode=0o700)
        shutil.copyfile(tables / paths.MLFLOW_DB, folder / paths.MLFLOW_DB)
        os.chmod(folder / paths.MLFLOW_DB, 0o600)
        return str(folder)

    return made


@pytest.fixture
def store(tmp_path, monkeypatch, new_store):
    """A fresh embedded MLflow store, and no MLflow configuration left over from another test."""
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from mlflow.tracking._tracking_service import utils as tracking_utils

    monkeypatch.chdir(tmp_path)  # MLflow's own defaults (./mlruns) must not land in the repository
    monkeypatch.setenv("AIR_MAGIC_MLFLOW_DIR", new_store(tmp_path / "mlflow"))
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
    yield MlflowClient(paths.embedded_mlflow_uri())
    while mlflow.active_run():
        mlflow.end_run()


_ray: dict[str, Any] = {}  # the Ray cluster of the tests, while it is up


@pytest.fixture
def ray_cluster():
    """A real Ray cluster of 3 nodes on this machine, one fake GPU each (placement spreads ranks
    over nodes; the ranks run on the CPU with gloo, as no node has an NVIDIA driver). Loopback only.

    One for all the tests that use it, which run one after another (pytest_collection_modifyitems
    sorts them last; under xdist they are one group): it starts with the first (20 s) and stops
    after the last (pytest_runtest_teardown), as a connected driver holds sockets and Ray's
    processes, children of this one, use CPU while idle. A test that takes a node away puts one back."""
    if "cluster" not in _ray:
        _ray["cluster"] = _start_ray_cluster()
    return _ray["cluster"]


def _start_ray_cluster() -> Any:
    # Before Ray is imported (it reads them then): every listener and address on 127.0.0.1 (NOTES.md).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray = pytest.importorskip("ray")
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    ray_constants.ENABLE_RAY_CLUSTER = False  # in case another test imported Ray first
    node = {"num_cpus": 2, "num_gpus": 1, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    cluster.node_args = node  # for tests that add a node back
    return cluster


def _stop_ray_cluster() -> None:
    cluster = _ray.pop("cluster", None)
    if cluster is None:
        return
    import ray

    from air_magic.backends.ray import placement

    placement.release_all(force=True)
    ray.shutdown()
    cluster.shutdown()
    deadline = time.monotonic() + 20
    while any(rays_own(p) for p in psutil.Process().children(recursive=True)):
        if time.monotonic() > deadline:
            break  # the next test's leftover check names them
        reap_zombies()
        time.sleep(0.1)


def pytest_collection_finish(session: pytest.Session) -> None:
    sys.dont_write_bytecode = _DONT_WRITE_BYTECODE  # what the tests import from now on: as the user set


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if "cluster" in _ray and (nextitem is None or not _on_the_ray_cluster(nextitem)):
        _stop_ray_cluster()


def pytest_sessionfinish(session: pytest.Session) -> None:
    _stop_ray_cluster()  # a run stopped early (-x, Ctrl-C) between two of its tests
