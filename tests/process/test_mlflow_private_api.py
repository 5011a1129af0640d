"""The MLflow APIs air_magic uses that MLflow does not promise to keep (docs/architecture.md,
"Private MLflow APIs we depend on"): one test per API, then what the code does without them.

Each test fails with a message naming the API, the air_magic file that uses it and the
MLflow version, so an MLflow upgrade that removes or changes one is caught here, not in a
user's notebook. The checks are of existence, of the parameters air_magic passes, and, where
it is cheap, of the behaviour air_magic relies on.
"""

from __future__ import annotations

import http.server
import importlib
import inspect
import os
import socket
import sys
import threading
import time
import types
from typing import Any

import pytest

mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import fluent  # noqa: E402

from air_magic.protocol import env_names  # noqa: E402
from air_magic.tracking import remote  # noqa: E402
from air_magic.tracking import store as tracking_store  # noqa: E402
from air_magic.worker import metrics as rank_metrics  # noqa: E402
from air_magic.worker import mlflow_hook  # noqa: E402


def _api(dotted: str, used_in: str) -> Any:
    """``module.attribute`` from MLflow, or a failure naming it and its user."""
    module_name, _, attribute = dotted.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        pytest.fail(f"{_who(dotted, used_in)}: module {module_name} cannot be imported ({exc})")
    if not hasattr(module, attribute):
        pytest.fail(f"{_who(dotted, used_in)}: {module_name} has no {attribute!r} any more")
    return getattr(module, attribute)


def _takes(
    func: Any, dotted: str, used_in: str, *args: Any, named: tuple[str, ...] = (), **kwargs: Any
) -> None:
    """``func`` accepts the call air_magic makes; ``named``: keywords that must be its own
    parameters, not swallowed by a ``**kwargs`` that passes them on elsewhere."""
    signature = inspect.signature(func)
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        pytest.fail(f"{_who(dotted, used_in)}: no longer takes the call we make ({exc}); now {signature}")
    missing = [name for name in named if name not in signature.parameters]
    assert not missing, f"{_who(dotted, used_in)}: lost the parameter(s) {missing}; now {signature}"


def _who(dotted: str, used_in: str) -> str:
    return f"MLflow {mlflow.__version__}: {dotted} (used by {used_in})"


# The APIs, one test each.


def test_is_tracking_uri_set(store, monkeypatch):
    """Whether the user chose a store: theirs, else the embedded one."""
    name = "mlflow.tracking._tracking_service.utils.is_tracking_uri_set"
    is_set = _api(name, "air_magic/tracking/store.py")
    _takes(is_set, name, "air_magic/tracking/store.py")
    assert is_set() is False, f"{_who(name, 'air_magic/tracking/store.py')}: True with nothing set"
    mlflow.set_tracking_uri("sqlite:///elsewhere.db")  # the store fixture puts it back after
    assert is_set() is True, (
        f"{_who(name, 'air_magic/tracking/store.py')}: False after mlflow.set_tracking_uri()"
    )


def test_active_experiment_id(store, tmp_path):
    """The notebook's ``set_experiment()`` choice, read by the caller and by a rank's hook."""
    name = "mlflow.tracking.fluent._active_experiment_id"
    users = "air_magic/tracking/store.py, air_magic/worker/mlflow_hook.py"
    _api(name, users)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/check.db")
    chosen = mlflow.set_experiment("private-api-check").experiment_id
    assert fluent._active_experiment_id == chosen, f"{_who(name, users)}: not set by set_experiment()"
    # mlflow_hook's fallback without it: set_experiment() exports the choice.
    assert os.environ.get("MLFLOW_EXPERIMENT_ID") == chosen, (
        f"MLflow {mlflow.__version__}: set_experiment() no longer exports MLFLOW_EXPERIMENT_ID "
        "(air_magic/worker/mlflow_hook.py falls back on it when _active_experiment_id is gone)"
    )


def test_get_or_start_run(store, tmp_path):
    """A metric for the shared run after the rank's ``end_run()``: MLflow resumes it, so do we."""
    name = "mlflow.tracking.fluent._get_or_start_run"
    get_or_start = _api(name, "air_magic/worker/metrics.py")
    _takes(get_or_start, name, "air_magic/worker/metrics.py")
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/check.db")
    with mlflow.start_run() as run:
        assert get_or_start().info.run_id == run.info.run_id, (
            f"{_who(name, 'air_magic/worker/metrics.py')}: not the active run"
        )


def test_validate_metric():
    """A rank's metric is checked as MLflow checks it, at the user's line."""
    name = "mlflow.utils.validation._validate_metric"
    validate = _api(name, "air_magic/worker/metrics.py")
    _takes(validate, name, "air_magic/worker/metrics.py", "loss", 0.5, 1_700_000_000_000, 3)
    validate("loss", 0.5, 1_700_000_000_000, 3)
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException):
        validate("loss", "not a number", 1_700_000_000_000, 3)


def test_run_operations():
    """What a batched ``log_metric(synchronous=False)`` returns: an operation already done."""
    name = "mlflow.utils.async_logging.run_operations.RunOperations"
    run_operations = _api(name, "air_magic/worker/metrics.py")
    _takes(run_operations, name, "air_magic/worker/metrics.py", [])
    done = run_operations([])
    started = time.monotonic()
    done.wait()
    assert time.monotonic() - started < 1, (
        f"{_who(name, 'air_magic/worker/metrics.py')}: wait() on no operations waited"
    )


def test_get_default_host_creds():
    """MLflow's credentials and TLS settings for the health check of a remote server."""
    name = "mlflow.utils.credentials.get_default_host_creds"
    host_creds = _api(name, "air_magic/tracking/remote.py")
    _takes(host_creds, name, "air_magic/tracking/remote.py", "http://127.0.0.1:1")
    assert host_creds("http://127.0.0.1:1").host == "http://127.0.0.1:1", _who(
        name, "air_magic/tracking/remote.py"
    )


def test_http_request():
    """One GET to a remote server's ``/health``: no retry, bounded, any HTTP answer below 500 counts
    (the answer's ``status_code`` is read: a 5xx, which MLflow retries for minutes, does not)."""
    name = "mlflow.utils.rest_utils.http_request"
    request = _api(name, "air_magic/tracking/remote.py")
    named = ("max_retries", "backoff_factor", "timeout", "raise_on_status")
    _takes(request, name, "air_magic/tracking/remote.py", None, "/health", "GET", named=named)
    from mlflow.utils.credentials import get_default_host_creds

    with _http_server(404) as uri:  # an answer, not a healthy one: it must not raise
        request(
            get_default_host_creds(uri), "/health", "GET",
            max_retries=0, backoff_factor=0, timeout=5, raise_on_status=False,
        )  # fmt: skip
        assert remote.unreachable(uri, 5) is None
    with _http_server(502) as uri:
        assert remote.unreachable(uri, 5) == "answered HTTP 502 to /health", (
            f"{_who(name, 'air_magic/tracking/remote.py')}: the answer has no status_code any more"
        )
    closed = f"http://127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    why = remote.unreachable(closed, 5)
    assert why == "refused the connection", (
        f"{_who(name, 'air_magic/tracking/remote.py')}: a refusal now reads {why!r}"
    )
    assert time.monotonic() - started < 5, (
        f"{_who(name, 'air_magic/tracking/remote.py')}: max_retries=0 retried"
    )


def test_mlflow_client_set_terminated_is_what_end_run_calls(store, tmp_path, monkeypatch):
    """A rank's ``end_run()`` must not end the shared run: the hook patches ``set_terminated``
    on the class in ``mlflow.tracking.client``, which ``fluent.end_run`` must go through."""
    name = "mlflow.tracking.client.MlflowClient.set_terminated"
    client_class = _api("mlflow.tracking.client.MlflowClient", "air_magic/worker/mlflow_hook.py")
    assert "mlflow.tracking.client" in mlflow_hook._PATCHES
    assert client_class is mlflow.tracking.MlflowClient, (
        f"{_who(name, 'air_magic/worker/mlflow_hook.py')}: moved"
    )
    _takes(client_class.set_terminated, name, "air_magic/worker/mlflow_hook.py", None, "run", "KILLED", 0)
    ended = []
    original = client_class.set_terminated

    def set_terminated(self, run_id, status=None, end_time=None):
        ended.append(run_id)
        original(self, run_id, status, end_time)

    monkeypatch.setattr(client_class, "set_terminated", set_terminated)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/check.db")
    run = mlflow.start_run()
    mlflow.end_run()
    assert ended == [run.info.run_id], (
        f"{_who(name, 'air_magic/worker/mlflow_hook.py')}: end_run() does not call it"
    )


def test_mlflow_client_create_run_is_what_start_run_calls(store, tmp_path, monkeypatch):
    """A run a rank makes is a child of the shared run: the hook patches ``create_run`` on the
    class, which Lightning's logger calls and fluent ``start_run`` must go through."""
    name = "mlflow.tracking.client.MlflowClient.create_run"
    client_class = _api("mlflow.tracking.client.MlflowClient", "air_magic/worker/mlflow_hook.py")
    _takes(client_class.create_run, name, "air_magic/worker/mlflow_hook.py", None, "0", None, {}, None)
    _takes(client_class.create_run, name, "air_magic/worker/mlflow_hook.py", None, "0", tags={})
    made = []
    original = client_class.create_run

    def create_run(self, experiment_id, start_time=None, tags=None, run_name=None):
        made.append(experiment_id)
        return original(self, experiment_id, start_time, tags, run_name)

    monkeypatch.setattr(client_class, "create_run", create_run)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/check.db")
    with mlflow.start_run(run_name="x") as run:
        pass
    assert made == [run.info.experiment_id], (
        f"{_who(name, 'air_magic/worker/mlflow_hook.py')}: start_run() does not call it"
    )


def test_metric_rows_written_into_sqlite_tables_read_back_as_log_batchs(store, tmp_path):
    """The caller writes the ranks' metric rows straight into MLflow's tables of a sqlite store
    (air_magic/tracking/metric_rows.py): MLflow must read them back exactly as it reads the same
    rows written by its own ``log_batch``: histories, latest values, NaN, infinities, duplicates."""
    from mlflow.tracking import MlflowClient

    from air_magic.tracking import metric_rows

    used_in = "air_magic/tracking/metric_rows.py"
    client = MlflowClient(f"sqlite:///{tmp_path}/rows.db")
    sink = metric_rows.sink_for(client, "unused")
    assert isinstance(sink, metric_rows.SqliteRows), f"{_who('SqlAlchemyStore.engine', used_in)}: not found"
    experiment = client.create_experiment("rows", artifact_location=(tmp_path / "a").as_uri())
    ours, theirs = (client.create_run(experiment).info.run_id for _ in range(2))
    t = 1_700_000_000_000
    nan, inf = float("nan"), float("inf")
    writes = [  # each a pass of the writer; the latest value moves (or not) across them
        [("loss", 0.5, t, 0), ("loss", 0.25, t + 1, 1), ("loss", 0.25, t + 1, 1), ("acc", nan, t, 0),
         ("lr", 0.1, t, 7)],
        [("loss", 0.75, t + 5, 1), ("acc", inf, t, 1), ("lr", 0.05, t, 7)],  # later; same step, lower
        [("loss", 0.1, t + 2, 3), ("loss", 0.9, t + 3, 2), ("acc", -inf, t, 2), ("acc", nan, t + 9, 2),
         ("lr", 0.2, t, 7)],  # a step further; out of order; NaN after -inf at a step; higher value
        [("loss", 0.3, t, 0), ("acc", 0.5, t + 9, 2)],  # older; equal step and time: 0.5 > the 0 of NaN
    ]  # fmt: skip
    for rows in writes:
        metric_rows.SqliteRows(sink.engine, ours).write(rows)
        metric_rows.LogBatch(client, theirs).write(rows)

    def history(run_id, key):
        return sorted(
            (m.step, m.timestamp, repr(m.value))  # repr: NaN equals NaN, and sorts
            for m in client.get_metric_history(run_id, key)
        )

    for key in ("loss", "acc", "lr"):
        assert history(ours, key) == history(theirs, key), (key, f"{_who('metrics table', used_in)}")
    latest = [client.get_run(r).data.metrics for r in (ours, theirs)]
    assert str(latest[0]) == str(latest[1]), f"{_who('latest_metrics table', used_in)}: {latest}"
    assert latest[0] == {"loss": 0.1, "acc": 0.5, "lr": 0.2}, latest
    found = client.search_runs([experiment], "metrics.loss > 0.05")
    assert sorted(r.info.run_id for r in found) == sorted([ours, theirs])


def test_fluent_is_where_mlflow_start_run_and_log_metric_live():
    """The hook patches ``mlflow.tracking.fluent`` as it is imported, before ``mlflow/__init__``
    binds these names: they must be fluent's own."""
    assert "mlflow.tracking.fluent" in mlflow_hook._PATCHES
    for attribute in ("start_run", "log_metric", "log_metrics", "active_run"):
        name = f"mlflow.tracking.fluent.{attribute}"
        found = _api(name, "air_magic/worker/mlflow_hook.py, air_magic/worker/metrics.py")
        assert getattr(mlflow, attribute) is found, (
            f"MLflow {mlflow.__version__}: mlflow.{attribute} is not {name}"
        )


def test_health_endpoint():
    """``mlflow server`` answers ``/health``: ui.py waits for its 200, remote.py asks it."""
    from mlflow.server import app

    rules = [rule.rule for rule in app.url_map.iter_rules()]
    assert "/health" in rules, (
        f"MLflow {mlflow.__version__}: mlflow server has no /health "
        "(used by air_magic/tracking/ui.py and air_magic/tracking/remote.py)"
    )


# Public APIs whose parameters air_magic mirrors or passes: a change breaks a wrapper.


def test_start_run_takes_every_keyword_the_hook_passes():
    name = "mlflow.tracking.fluent.start_run"
    keywords = ("run_id", "experiment_id", "run_name", "nested", "parent_run_id", "tags", "description")
    _takes(fluent.start_run, name, "air_magic/worker/mlflow_hook.py", named=keywords)


@pytest.mark.parametrize("function", ["log_metric", "log_metrics"])
def test_the_metric_wrappers_take_every_parameter_mlflow_does(function, tmp_path, monkeypatch):
    """MLflow's parameters, in order, must start ours: else a user passing a new one (or one
    by position) gets a TypeError from our wrapper, not MLflow's behaviour."""
    wrapped = _batched_fluent(tmp_path, monkeypatch)
    theirs = list(inspect.signature(getattr(fluent, function)).parameters)
    ours = list(inspect.signature(getattr(wrapped, function), follow_wrapped=False).parameters)
    assert ours[: len(theirs)] == theirs, (
        f"MLflow {mlflow.__version__}: mlflow.{function} takes {theirs}; the wrapper in "
        f"air_magic/worker/metrics.py takes {ours}"
    )


# Without them: the code degrades instead of failing the call.


def test_without_is_tracking_uri_set_only_the_variable_counts(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow.tracking._tracking_service.utils", None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    with pytest.warns(RuntimeWarning, match="set_tracking_uri"):
        assert tracking_store._user_set_tracking_uri() is True
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    with pytest.warns(RuntimeWarning):
        assert tracking_store._user_set_tracking_uri() is False


def test_without_http_request_the_health_check_is_skipped(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow.utils.rest_utils", None)
    with pytest.warns(RuntimeWarning, match="MLflow's own retries apply"):
        assert remote.unreachable(f"http://127.0.0.1:{_closed_port()}", 1) is None


def test_a_changed_http_request_skips_the_health_check(monkeypatch):
    import mlflow.utils.rest_utils as rest_utils

    monkeypatch.setattr(rest_utils, "http_request", lambda host_creds, endpoint, method: None)
    with pytest.warns(RuntimeWarning, match="MLflow's own retries apply"):
        assert remote.unreachable(f"http://127.0.0.1:{_closed_port()}", 1) is None


@pytest.mark.parametrize("module", ["mlflow.utils.validation", "mlflow.utils.async_logging.run_operations"])
def test_without_the_validator_metrics_take_mlflows_own_path(module, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.warns(RuntimeWarning, match="MLflow's own"):
        wrapped = _batched_fluent(tmp_path, monkeypatch)
    assert wrapped.log_metric is fluent.log_metric and wrapped.log_metrics is fluent.log_metrics


def test_a_changed_validator_leaves_the_metric_functions_alone(tmp_path, monkeypatch):
    import mlflow.utils.validation as validation

    monkeypatch.setattr(validation, "_validate_metric", lambda key, value, timestamp, step, dataset: None)
    with pytest.warns(RuntimeWarning, match="MLflow's own"):
        wrapped = _batched_fluent(tmp_path, monkeypatch)
    assert wrapped.log_metric is fluent.log_metric


def test_without_active_experiment_id_the_hook_reads_the_variable(monkeypatch):
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "42")
    assert mlflow_hook._chosen_experiment(types.ModuleType("fluent_without_it")) == "42"
    with_it = types.ModuleType("fluent_with_it")
    with_it._active_experiment_id = None  # type: ignore[attr-defined]
    assert mlflow_hook._chosen_experiment(with_it) is None  # present: MLflow's word, as before


def test_without_active_experiment_id_the_caller_reads_the_variable(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow.tracking.fluent", types.ModuleType("fluent_without_it"))
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    assert tracking_store.active_experiment_id() is None
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "42")
    assert tracking_store.active_experiment_id() == "42"


# Helpers.


def _batched_fluent(tmp_path, monkeypatch) -> types.ModuleType:
    """A stand-in for ``mlflow.tracking.fluent`` after worker/metrics.py patched it, as in a rank."""
    monkeypatch.setenv(env_names.SHARED_RUN, "shared-run")
    monkeypatch.setenv(env_names.METRICS_DIR, str(tmp_path))
    monkeypatch.delenv(env_names.METRICS_MODE, raising=False)
    monkeypatch.setenv("RANK", "0")
    for attribute in ("log_metric", "log_metrics"):  # patch_fluent rebinds mlflow's too: put back after
        monkeypatch.setattr(mlflow, attribute, getattr(mlflow, attribute))
    stand_in = types.ModuleType("fluent_stand_in")
    for attribute in ("log_metric", "log_metrics", "active_run", "_get_or_start_run", "get_active_model_id"):
        if hasattr(fluent, attribute):
            setattr(stand_in, attribute, getattr(fluent, attribute))
    rank_metrics.patch_fluent(stand_in)
    return stand_in


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens on it once this closes


class _http_server:
    """A server on 127.0.0.1 that answers every GET with ``status``."""

    def __init__(self, status: int):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.HTTPServer(("127.0.0.1", 0), Handler)

    def __enter__(self) -> str:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
