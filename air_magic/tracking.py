"""MLflow: one run per call, created in the caller before launch, ended truthfully after.

- **Store.** The user's MLflow configuration wins: a tracking URI set with
  ``mlflow.set_tracking_uri`` or ``MLFLOW_TRACKING_URI``, or, when the notebook
  already has an active run or experiment, whatever store MLflow is using.
  Otherwise air_magic uses an embedded sqlite store that needs no server:
  ``$XDG_STATE_HOME/air_magic/mlflow/mlflow.db`` with artifacts beside it
  (``AIR_MAGIC_MLFLOW_DIR`` moves both).
- **Experiment.** ``experiment=`` (``--experiment``), else the notebook's active
  run's or active experiment, else ``MLFLOW_EXPERIMENT_ID`` /
  ``MLFLOW_EXPERIMENT_NAME``, else the notebook's name (from Jupyter's
  ``JPY_SESSION_NAME``) or the script's, else ``air_magic``.
- **Nesting.** With an active run in the notebook, the call's run is its child.
- **Ranks** get ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_ID`` and
  ``MLFLOW_RUN_ID``; ``rank_mlflow`` keeps a rank from ending the shared run.
- **Metrics** a rank logs with ``mlflow.log_metric``/``log_metrics`` go through
  a file to this process's :class:`~air_magic.metric_writer.MetricWriter`, which
  writes them in batches (``AIR_MAGIC_METRICS=direct``: MLflow's own path).
- **Recorded:** launch parameters, the function's or cell's source, every
  rank's log, the outcome; status FINISHED, FAILED (rank failure, timeout) or
  KILLED (interrupt), set in a ``finally``.

``import mlflow`` costs seconds, so it happens only here, once per process,
and only when tracking is on. Without mlflow installed a call runs untracked,
with a one-line note.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
import os
import platform
import re
import shutil
import socket
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any

from air_magic import wire
from air_magic._version import __version__
from air_magic.accelerators import AcceleratorPlan
from air_magic.events import Event, RunFinished, RunStarted
from air_magic.metric_writer import MetricWriter
from air_magic.rank_metrics import ENV_SHARED

_STATUS = {"succeeded": "FINISHED", "failed": "FAILED", "timeout": "FAILED", "interrupted": "KILLED"}
_missing_said = False
_reaped: set[str] = set()  # tracking URIs already checked for runs whose caller died
_live: list[TrackedRun] = []  # runs of this process not yet ended (for atexit)


def embedded_dir() -> str:
    return os.environ.get("AIR_MAGIC_MLFLOW_DIR") or wire.state_dir("mlflow")


def embedded_uri() -> str:
    return "sqlite:///" + os.path.join(embedded_dir(), "mlflow.db")


@dataclass
class TrackedRun:
    """The MLflow run of one call. A consumer of launch events, and ended by :meth:`finish`."""

    client: Any
    run_id: str
    experiment_id: str
    tracking_uri: str
    url: str | None
    env: dict[str, str]
    log_dir: str | None = None
    failed_rank: int | None = None
    error: str | None = None
    metrics: MetricWriter | None = None
    finished: bool = field(default=False, repr=False)

    def describe(self) -> str:
        where = self.url or f"{self.tracking_uri} (%distributed mlflow-ui opens it in a browser)"
        return f"MLflow run {self.run_id} in experiment {self.experiment_id}: {where}"

    def handle(self, event: Event) -> None:
        if isinstance(event, RunStarted):
            self.log_dir = event.log_dir
            self.client.set_tag(self.run_id, "air_magic.run_id", event.run_id)
            if self.metrics is not None:
                self.metrics.start()
        elif isinstance(event, RunFinished):
            self.failed_rank = event.failed_rank
            self.error = event.error
            self._close_metrics()  # every rank is gone: what they logged is all in the files

    def _close_metrics(self) -> None:
        metrics, self.metrics = self.metrics, None
        if metrics is not None:
            metrics.close()
            shutil.rmtree(metrics.directory, ignore_errors=True)

    def finish(self, outcome: str) -> None:
        """Log what is left and end the run with the status that matches ``outcome``. Never raises."""
        if self.finished:
            return
        self.finished = True
        if self in _live:
            _live.remove(self)
        self._close_metrics()  # no-op after RunFinished; here for calls that ended before launch
        tags = {"air_magic.outcome": outcome}
        if self.failed_rank is not None:
            tags["air_magic.failed_rank"] = str(self.failed_rank)
        if self.error:
            tags["air_magic.error"] = self.error.splitlines()[0][:4000]
        try:
            for key, value in tags.items():
                self.client.set_tag(self.run_id, key, value)
            if self.log_dir and os.path.isdir(self.log_dir):
                self.client.log_artifacts(self.run_id, self.log_dir, "logs")
        except Exception as exc:  # noqa: BLE001 - the run must still be ended below
            _warn(f"could not record logs and tags in MLflow run {self.run_id}: {exc}")
        try:
            self.client.set_terminated(self.run_id, _STATUS.get(outcome, "FAILED"))
        except Exception as exc:  # noqa: BLE001 - never hide the call's own outcome
            _warn(f"could not end MLflow run {self.run_id}: {exc}")


def start_run(
    *,
    name: str,
    kind: str,
    source: str | None,
    plan: AcceleratorPlan,
    timeout: float | None,
    accelerator_type: str | None,
    experiment: str | None,
    run_name: str | None,
) -> TrackedRun | None:
    """Create the call's run, or return None when mlflow is not installed."""
    global _missing_said
    try:
        import mlflow
        from mlflow.tracking import MlflowClient
    except ImportError:
        if not _missing_said:
            _missing_said = True
            print(
                "air_magic: MLflow is not installed, so calls are not tracked "
                "(pip install 'air_magic[mlflow]', or tracking=False to silence this)",
                file=sys.stderr,
            )
        return None

    active = mlflow.active_run()
    uri = _tracking_uri(mlflow, active)
    client = MlflowClient(tracking_uri=uri)
    if uri not in _reaped:
        _reaped.add(uri)
        _end_orphaned_runs(client)
    experiment_id = _experiment_id(mlflow, client, uri, active, experiment)
    tags = {"mlflow.source.name": name, "mlflow.source.type": "NOTEBOOK" if kind == "cell" else "LOCAL"}
    tags["air_magic.kind"] = kind
    tags["air_magic.host"] = socket.gethostname()
    tags["air_magic.caller"] = _caller_id()
    if active is not None and active.info.experiment_id == experiment_id:
        tags["mlflow.parentRunId"] = active.info.run_id
    run = client.create_run(experiment_id, run_name=run_name or _run_name(name), tags=tags)
    run_id = run.info.run_id
    params = {
        "world_size": plan.world_size,
        "backend": plan.backend,
        "accelerators": plan.detected,
        "accelerator_type": accelerator_type or "auto",
        "timeout_s": "none" if timeout is None else f"{timeout:g}",
        "function" if kind == "function" else "cell": name,
        "air_magic_version": __version__,
        "torch_version": _version("torch"),
        "python_version": platform.python_version(),
    }
    from mlflow.entities import Param

    client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()])
    if source:
        client.log_text(run_id, source, f"source/{_safe(name)}.py")
    env = {
        "MLFLOW_TRACKING_URI": uri,
        "MLFLOW_EXPERIMENT_ID": experiment_id,
        "MLFLOW_RUN_ID": run_id,
        ENV_SHARED: run_id,
    }
    metrics = None
    if os.environ.get(wire.ENV_METRICS_MODE, "batched") != "direct":
        metrics = MetricWriter(client, run_id, tempfile.mkdtemp(prefix="air_magic-metrics-"))  # 0700
        env[wire.ENV_METRICS_DIR] = metrics.directory
    from air_magic import mlflow_ui

    url = mlflow_ui.run_url(uri, experiment_id, run_id)
    tracked = TrackedRun(client, run_id, experiment_id, uri, url, env, metrics=metrics)
    _live.append(tracked)
    return tracked


def _caller_id() -> str:
    """This process, in a form that survives pid reuse: ``pid:start-time``."""
    import psutil

    me = psutil.Process()
    return f"{me.pid}:{me.create_time():.3f}"


def _end_orphaned_runs(client: Any) -> None:
    """Mark KILLED the runs of this machine whose caller died mid-call (kernel killed or restarted).

    A process killed with SIGKILL cannot end its own run; the next process that
    tracks into the same store does it for it, once, on its first call.
    """
    import psutil

    try:
        experiments = [e.experiment_id for e in client.search_experiments()]
        if not experiments:
            return
        host = socket.gethostname().replace("'", "")
        runs = client.search_runs(
            experiments,
            filter_string=f"attributes.status = 'RUNNING' and tags.`air_magic.host` = '{host}'",
            max_results=200,
        )
        for run in runs:
            caller = run.data.tags.get("air_magic.caller", "")
            pid_text, _, started = caller.partition(":")
            try:
                caller_proc = psutil.Process(int(pid_text))
                # Same pid and start time, and not a zombie (dead, waiting for its parent to reap it).
                alive = (
                    f"{caller_proc.create_time():.3f}" == started
                    and caller_proc.status() != psutil.STATUS_ZOMBIE
                )
            except (ValueError, psutil.Error):
                alive = False
            if not alive:
                client.set_tag(run.info.run_id, "air_magic.outcome", "caller ended")
                client.set_tag(
                    run.info.run_id,
                    "air_magic.error",
                    "the process that made this call ended before the call did (kernel restart or kill)",
                )
                client.set_terminated(run.info.run_id, "KILLED")
    except Exception as exc:  # noqa: BLE001 - housekeeping must never stop a call
        _warn(f"could not check for runs left RUNNING by ended processes: {exc}")


@atexit.register
def _end_live_runs() -> None:
    """A caller that exits in an orderly way mid-call (kernel shutdown) ends its runs as KILLED."""
    for tracked in list(_live):
        tracked.finish("interrupted")


def current_uri() -> str:
    """The tracking URI the next call would use."""
    import mlflow

    return _tracking_uri(mlflow, mlflow.active_run())


def _tracking_uri(mlflow: Any, active: Any) -> str:
    from mlflow.tracking._tracking_service import utils

    user_configured = utils.is_tracking_uri_set()
    fluent = sys.modules.get("mlflow.tracking.fluent")
    experiment_set = getattr(fluent, "_active_experiment_id", None) is not None
    if user_configured or active is not None or experiment_set:
        return str(mlflow.get_tracking_uri())
    os.makedirs(embedded_dir(), mode=0o700, exist_ok=True)
    return embedded_uri()


def _experiment_id(mlflow: Any, client: Any, uri: str, active: Any, explicit: str | None) -> str:
    if explicit is None:
        if active is not None:
            return str(active.info.experiment_id)
        fluent = sys.modules.get("mlflow.tracking.fluent")
        chosen = getattr(fluent, "_active_experiment_id", None)
        if chosen is not None:
            return str(chosen)
        if os.environ.get("MLFLOW_EXPERIMENT_ID"):
            return os.environ["MLFLOW_EXPERIMENT_ID"]
    name = explicit or os.environ.get("MLFLOW_EXPERIMENT_NAME") or _default_experiment_name()
    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    location = None
    if uri == embedded_uri():
        # Keep artifacts beside the embedded store, not in whatever the cwd is.
        location = "file://" + os.path.join(embedded_dir(), "artifacts", _safe(name))
    try:
        return str(client.create_experiment(name, artifact_location=location))
    except Exception:  # another process may have created it first (re-raised below if not)
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return str(found.experiment_id)


def _default_experiment_name() -> str:
    session = os.environ.get("JPY_SESSION_NAME")  # set by Jupyter for a notebook's kernel
    if session:
        return os.path.splitext(os.path.basename(session))[0] or "air_magic"
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or os.path.basename(path).startswith("ipykernel_launcher"):
        return "air_magic"
    stem = os.path.splitext(os.path.basename(path))[0]
    if stem == "__main__":  # python -m package: the package's name
        spec = getattr(main, "__spec__", None)
        stem = (getattr(spec, "parent", "") or "").split(".")[0] or "air_magic"
    return stem


def _run_name(name: str) -> str:
    return re.sub(r"[^\w.\- \[\]]", "_", name)[:200]


def _safe(name: str) -> str:
    return re.sub(r"[^\w.-]+", "_", name).strip("_") or "run"


def _version(package: str) -> str:
    # The distribution's metadata, not an import: torch takes seconds to import.
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _warn(message: str) -> None:
    with contextlib.suppress(Exception):
        warnings.warn(f"air_magic: {message}", RuntimeWarning, stacklevel=3)
