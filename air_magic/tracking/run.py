"""MLflow: one run per call, created in the caller before launch, ended truthfully after.

- **Store.** The user's MLflow configuration wins: a tracking URI set with
  ``mlflow.set_tracking_uri`` or ``MLFLOW_TRACKING_URI``, or, when the notebook
  already has an active run or experiment, whatever store MLflow is using.
  Otherwise air_magic uses an embedded sqlite store that needs no server:
  ``$XDG_STATE_HOME/air_magic/mlflow/mlflow.db`` with artifacts beside it
  (``AIR_MAGIC_MLFLOW_DIR`` moves both). Processes open it one at a time
  (``flock`` on ``mlflow.db.lock``): MLflow makes its tables on first open, and
  processes doing that at once fail.
- **Experiment.** ``experiment=`` (``--experiment``), else the notebook's active
  run's or active experiment, else ``MLFLOW_EXPERIMENT_ID`` /
  ``MLFLOW_EXPERIMENT_NAME``, else the notebook's name (from Jupyter's
  ``JPY_SESSION_NAME``) or the script's, else ``air_magic``.
- **Nesting.** With an active run in the notebook, the call's run is its child.
- **Ranks** get ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_ID`` and
  ``MLFLOW_RUN_ID``; ``rank_mlflow`` keeps a rank from ending or renaming the
  shared run, and makes a run a rank starts for itself a child of it.
- **Metrics** a rank logs with ``mlflow.log_metric``/``log_metrics`` go through
  a file to this process's :class:`~air_magic.tracking.metric_writer.MetricWriter`, which
  writes them in batches (``AIR_MAGIC_METRICS=direct``: MLflow's own path).
- **Recorded:** launch parameters, the function's or cell's source, every
  rank's log, the outcome; status FINISHED, FAILED (rank failure, timeout) or
  KILLED (interrupt), set in a ``finally``. Runs the ranks started under it and
  left RUNNING (a killed rank) end with it.
- **Never on the caller's thread.** ``import mlflow`` and every MLflow request
  run on helper threads (:func:`import_mlflow`, :class:`RunStart`); the
  caller's thread only waits. So an interrupt at any moment stops a wait, never
  an import half-way (which would break every later call) nor the run's end
  (which would leave it RUNNING).
- **An unreachable tracking server** (http/https) costs at most
  :data:`REMOTE_CHECK_S` (or the call's ``timeout`` if shorter): one request to
  its ``/health`` without retries, then one loud line, and the call runs
  untracked. Why not fail the call: the ranks' work matters more than its
  record, and their logs are kept on disk either way; why not MLflow's own
  retries: 7 retries of up to 120 s each, twice, held every call for minutes
  and ignored ``timeout=``. A server that answers is given
  :data:`REMOTE_SETUP_S` to create the run and :data:`REMOTE_END_S` to confirm
  its end; past that the call goes on and the work finishes in the background.
  MLflow's own settings (``MLFLOW_HTTP_REQUEST_*``) are left as they are.

``import mlflow`` costs seconds, so it happens only here, once per process,
and only when tracking is on. Without mlflow installed a call runs untracked,
with a one-line note.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import importlib.metadata
import os
import platform
import queue
import re
import shutil
import socket
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from air_magic import paths, private_files
from air_magic._version import __version__
from air_magic.launch.accelerators import AcceleratorPlan
from air_magic.protocol import env_names
from air_magic.protocol.events import Event, RecordLink, RunFinished, RunStarted
from air_magic.tracking.metric_writer import MetricWriter

_STATUS = {
    "succeeded": "FINISHED",
    "failed": "FAILED",
    "timeout": "FAILED",
    "interrupted": "KILLED",
    "untracked": "KILLED",  # made too late: the call had gone on without it
}
# A remote (http/https) tracking server: how long it gets to answer a health check, to create the
# call's run (both also bounded by the call's timeout), and to confirm the run's end.
REMOTE_CHECK_S = 5.0
REMOTE_SETUP_S = 30.0
REMOTE_END_S = 30.0
AT_EXIT_WAIT_S = 30.0  # at interpreter exit: how long runs still open get to be ended
_missing_said = False
_imported: threading.Event | None = None  # set when the thread importing mlflow is done (import_mlflow)
_import_failure: BaseException | None = None
_reaped: set[str] = set()  # tracking URIs already checked for runs whose caller died
_live: list[TrackedRun] = []  # runs of this process not yet ended (for atexit)


@dataclass
class TrackedRun:
    """The MLflow run of one call. A consumer of launch events, and ended by :meth:`finish`.

    Its MLflow work runs on its owner thread (:meth:`serve`, see :class:`RunStart`), in order;
    the caller's thread only queues it in :attr:`jobs` and waits.
    """

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
    jobs: queue.SimpleQueue[Callable[[], object] | str] = field(default_factory=queue.SimpleQueue, repr=False)
    end_wait_s: float | None = None  # how long the caller waits for the run's end (None: until it is done)
    ended: threading.Event = field(default_factory=threading.Event, repr=False)

    def describe(self) -> str:
        where = self.url or f"{self.tracking_uri} (%distributed mlflow-ui opens it in a browser)"
        return f"MLflow run {self.run_id} in experiment {self.experiment_id}: {where}"

    def link(self) -> RecordLink:
        """The run as displays show it."""
        return RecordLink(run_id=self.run_id, description=self.describe(), url=self.url)

    def handle(self, event: Event) -> None:
        if isinstance(event, RunStarted):
            self.log_dir = event.log_dir
            tag = functools.partial(self.client.set_tag, self.run_id, "air_magic.run_id", event.run_id)
            self.jobs.put(tag)
            if self.metrics is not None:
                self.metrics.start()
        elif isinstance(event, RunFinished):
            self.failed_rank = event.failed_rank
            self.error = event.error

    def serve(self) -> None:
        """The owner thread: run the queued MLflow work in order; the call's outcome is the last job."""
        while True:
            job = self.jobs.get()
            if isinstance(job, str):
                try:
                    self._end(job)
                finally:
                    if self in _live:
                        _live.remove(self)
                    self.ended.set()
                return
            try:
                job()
            except Exception as exc:  # noqa: BLE001 - a tag that failed must not keep the run from ending
                _warn(f"MLflow run {self.run_id}: {exc}")

    def finish(self, outcome: str, wait_s: float | None = None) -> None:
        """End the run with the status that matches ``outcome`` (the first outcome given wins).

        The owner thread does it; this waits up to ``wait_s`` (default :attr:`end_wait_s`), so a
        server that stopped answering cannot hold the call. An interrupt stops the wait, not the end.
        """
        self.jobs.put(outcome)
        limit = self.end_wait_s if wait_s is None else wait_s
        if not self.ended.wait(limit):
            _warn(
                f"MLflow at {self.tracking_uri} did not confirm the end of run {self.run_id} within "
                f"{limit:g} s; it is still being ended in the background"
            )

    def _close_metrics(self) -> None:
        metrics, self.metrics = self.metrics, None
        if metrics is not None:
            metrics.close()
            shutil.rmtree(metrics.directory, ignore_errors=True)

    def _end(self, outcome: str) -> None:
        """Write what is left and end the run with the status that matches ``outcome``. Never raises."""
        self._close_metrics()  # every rank is gone: what they logged is all in the files
        self._end_children(outcome)
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
            if (
                self.tracking_uri == paths.embedded_mlflow_uri()
            ):  # MLflow makes them with the umask: 0644 files
                private_files.make_run_artifacts_private(
                    self.client, self.run_id, paths.embedded_mlflow_dir()
                )
        except Exception as exc:  # noqa: BLE001 - the run must still be ended below
            _warn(f"could not record logs and tags in MLflow run {self.run_id}: {exc}")
        try:
            self.client.set_terminated(self.run_id, _STATUS.get(outcome, "FAILED"))
        except Exception as exc:  # noqa: BLE001 - never hide the call's own outcome
            _warn(f"could not end MLflow run {self.run_id}: {exc}")

    def _end_children(self, outcome: str) -> None:
        """End the runs that ranks started under this one and left RUNNING (see rank_mlflow).

        A rank that was killed, timed out or interrupted cannot end its own child run; one that
        returned would have had it ended by MLflow at exit, with the call's status.
        """
        try:
            experiments = [e.experiment_id for e in self.client.search_experiments()]
            children = self.client.search_runs(
                experiments,
                filter_string=(
                    f"tags.`mlflow.parentRunId` = '{self.run_id}' and attributes.status = 'RUNNING'"
                ),
                max_results=1000,
            )
            for child in children:
                self.client.set_terminated(child.info.run_id, _STATUS.get(outcome, "FAILED"))
        except Exception as exc:  # noqa: BLE001 - the call's own run must still be ended
            _warn(f"could not end the runs the ranks started under MLflow run {self.run_id}: {exc}")


@dataclass(frozen=True)
class CallFacts:
    """What the call's run records of the call (known before anything launches)."""

    name: str
    kind: str  # 'function' or 'cell'
    source: str | None
    plan: AcceleratorPlan
    timeout: float | None
    accelerator_type: str | None
    experiment: str | None
    run_name: str | None


class RunStart:
    """Creates the call's run on an owner thread, which then does all of the run's MLflow work.

    Why a thread: nothing MLflow does may run on the caller's thread. There, an interrupt
    (Ctrl-C, the notebook's stop button) lands wherever the code happens to be: half-way
    through an import (leaving half-initialised modules that break every later call), or
    between creating the run and the ``try`` that ends it (leaving it RUNNING). Here the
    caller's thread only waits, and an interrupt only stops the wait: the owner thread finishes
    what it was doing, and :meth:`end`'s outcome ends the run, even one created after the
    interrupt (one not yet begun is not created). A wait on a thread can also be bounded: a
    remote server gets :func:`_setup_wait_s`, then the call runs untracked.
    """

    def __init__(self, call: CallFacts, log_root: str | None = None):
        self._call = call
        self._timeout = call.timeout
        self._log_root = log_root
        self._jobs: queue.SimpleQueue[Callable[[], object] | str] = queue.SimpleQueue()
        self._uri_known = threading.Event()
        self._ready = threading.Event()  # the run exists, or will not be made
        self.uri = ""
        self._tracked: TrackedRun | None = None
        self._unreachable: str | None = None
        self._error: BaseException | None = None

    def wait(self) -> TrackedRun | None:
        """The call's run, or None: mlflow not installed, or the tracking server not answering."""
        mlflow = import_mlflow()
        if mlflow is None:
            return None
        active = mlflow.active_run()  # MLflow keeps the active run per thread: read it on the caller's
        owner = threading.Thread(target=self._own, args=(mlflow, active), name="air_magic-run", daemon=True)
        owner.start()
        self._uri_known.wait()
        limit = _setup_wait_s(self.uri, self._timeout)
        if not self._ready.wait(limit):
            self._jobs.put("untracked")  # the run, when it comes, is ended at once
            _say_untracked(self.uri, f"did not create this call's run within {limit:g} s", self._log_root)
            return None
        if self._error is not None:
            raise self._error
        if self._unreachable is not None:
            _say_untracked(self.uri, self._unreachable, self._log_root)
        return self._tracked

    def end(self, outcome: str) -> None:
        """End the call's run with ``outcome``: now, or as soon as it exists. Call it in a ``finally``."""
        self._jobs.put(outcome)
        tracked = self._tracked
        if tracked is not None:
            tracked.finish(outcome)

    def _own(self, mlflow: Any, active: Any) -> None:
        """The owner thread: find the store, create the run, then do its work until its end."""
        try:
            self.uri = _tracking_uri(mlflow, active)
            self._uri_known.set()
            if _is_remote(self.uri):
                self._unreachable = _unreachable(self.uri, _check_s(_setup_wait_s(self.uri, self._timeout)))
            if self._unreachable is None:
                self._tracked = _create_run(mlflow, self.uri, active, self._jobs, self._call)
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            self._error = exc
        finally:
            self._uri_known.set()
            self._ready.set()
        if self._tracked is not None:
            self._tracked.serve()


def import_mlflow() -> ModuleType | None:
    """``mlflow``, imported once per process on a helper thread; None when it cannot be imported.

    ``import mlflow`` takes seconds, and a KeyboardInterrupt inside it leaves half-initialised
    mlflow and sqlalchemy modules in ``sys.modules``: every later ``import mlflow`` then fails
    (``partially initialized module``) until a restart. Signals reach only the main thread, so
    the import runs on another one and an interrupt stops only the wait. An import that fails
    anyway is cleaned up (:func:`_forget_orphans`) and tried again on the next call.

    The wait is on an Event, not ``Thread.join``: a join that an interrupt stops marks the
    thread as stopped though it still runs (CPython 3.11), and the next join would not wait.
    """
    global _imported, _missing_said
    imported = _imported
    if imported is None:
        imported = _imported = threading.Event()
        threading.Thread(
            target=_import_in_background, args=(imported,), name="air_magic-import-mlflow", daemon=True
        ).start()
    imported.wait()
    failure = _import_failure
    if failure is None:
        return sys.modules["mlflow"]
    _imported = None  # the next call tries again
    if not _missing_said:
        _missing_said = True
        if isinstance(failure, ImportError):
            why = "MLflow is not installed" + ("" if failure.name == "mlflow" else f" ({failure})")
        else:
            why = f"MLflow could not be imported ({type(failure).__name__}: {failure})"
        print(
            f"air_magic: {why}, so calls are not tracked "
            "(pip install 'air_magic[mlflow]', or tracking=False to silence this)",
            file=sys.stderr,
        )
    return None


def _import_in_background(done: threading.Event) -> None:
    global _import_failure
    before = set(sys.modules)
    try:
        import mlflow  # noqa: F401
        from mlflow.tracking import MlflowClient  # noqa: F401

        _import_failure = None
    except BaseException as exc:  # noqa: BLE001 - said on the caller's thread
        _import_failure = exc
        _forget_orphans(set(sys.modules) - before)
    finally:
        done.set()


def _forget_orphans(new_modules: set[str]) -> None:
    """Drop the modules of a failed import whose parent package did not survive it.

    Python drops the module that failed, and its parents; submodules that had finished stay,
    bound to a parent object no longer in ``sys.modules``, and a fresh import of the parent
    would skip them (``has no attribute``). Complete top-level modules stay: importing a C
    extension twice is worse than keeping it.
    """
    for name in sorted(new_modules, key=lambda n: n.count(".")):
        parts = name.split(".")
        parents = (".".join(parts[:i]) for i in range(1, len(parts)))
        if any(parent not in sys.modules for parent in parents):
            sys.modules.pop(name, None)


def _create_run(
    mlflow: Any, uri: str, active: Any, jobs: queue.SimpleQueue[Callable[[], object] | str], call: CallFacts
) -> TrackedRun | None:
    """Create the call's run (on its owner thread); None when the call ended before it began."""
    from mlflow.tracking import MlflowClient

    with _store_setup_lock(uri):
        client = MlflowClient(tracking_uri=uri)
    if uri not in _reaped:
        _reaped.add(uri)
        _end_orphaned_runs(client)
    experiment_id = _experiment_id(mlflow, client, uri, active, call.experiment)
    tags = {
        "mlflow.source.name": call.name,
        "mlflow.source.type": "NOTEBOOK" if call.kind == "cell" else "LOCAL",
    }
    tags["air_magic.kind"] = call.kind
    tags["air_magic.host"] = socket.gethostname()
    tags["air_magic.caller"] = _caller_id()
    if active is not None and active.info.experiment_id == experiment_id:
        tags["mlflow.parentRunId"] = active.info.run_id
    if not jobs.empty():
        return None  # the call was interrupted while its run was being prepared: nothing to record
    run = client.create_run(experiment_id, run_name=call.run_name or _run_name(call.name), tags=tags)
    run_id = run.info.run_id
    end_wait_s = REMOTE_END_S if _is_remote(uri) else None
    tracked = TrackedRun(client, run_id, experiment_id, uri, None, {}, jobs=jobs, end_wait_s=end_wait_s)
    _live.append(tracked)
    try:
        _describe_call(tracked, call)
    except BaseException:
        jobs.put("failed")  # the run exists: end it with the call, which fails with this error
        tracked.serve()
        raise
    return tracked


def _describe_call(tracked: TrackedRun, call: CallFacts) -> None:
    """Log the call's parameters and source; give the ranks their environment and the metric writer."""
    client, run_id, uri = tracked.client, tracked.run_id, tracked.tracking_uri
    experiment_id = tracked.experiment_id
    params = {
        "world_size": call.plan.world_size,
        "backend": call.plan.backend,
        "accelerators": call.plan.detected,
        "accelerator_type": call.accelerator_type or "auto",
        "timeout_s": "none" if call.timeout is None else f"{call.timeout:g}",
        "function" if call.kind == "function" else "cell": call.name,
        "air_magic_version": __version__,
        "torch_version": _version("torch"),
        "python_version": platform.python_version(),
    }
    from mlflow.entities import Param

    client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()])
    if call.source:
        client.log_text(run_id, call.source, f"source/{_safe(call.name)}.py")
    env = {
        "MLFLOW_TRACKING_URI": uri,
        "MLFLOW_EXPERIMENT_ID": experiment_id,
        "MLFLOW_RUN_ID": run_id,
        env_names.SHARED_RUN: run_id,
    }
    metrics = None
    if os.environ.get(env_names.METRICS_MODE, "batched") != "direct":
        metrics = MetricWriter(client, run_id, private_files.private_tempdir("metrics"))  # 0700
        env[env_names.METRICS_DIR] = metrics.directory
    from air_magic.tracking import ui as mlflow_ui

    tracked.url = mlflow_ui.run_url(uri, experiment_id, run_id)
    tracked.env = env
    tracked.metrics = metrics


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
        tracked.finish("interrupted", wait_s=AT_EXIT_WAIT_S)


def current_uri() -> str:
    """The tracking URI the next call would use."""
    mlflow = import_mlflow()
    if mlflow is None:
        raise ImportError("mlflow could not be imported", name="mlflow")
    return _tracking_uri(mlflow, mlflow.active_run())


def _is_remote(uri: str) -> bool:
    return uri.split(":", 1)[0].lower() in ("http", "https")


def _setup_wait_s(uri: str, timeout: float | None) -> float | None:
    """How long the call waits for its run: a remote server, bounded; a local store, until it is made."""
    if not _is_remote(uri):
        return None  # a local file or database: no network to wait on (an interrupt still stops the wait)
    return REMOTE_SETUP_S if timeout is None else min(REMOTE_SETUP_S, timeout)


def _check_s(setup_wait_s: float | None) -> float:
    return REMOTE_CHECK_S if setup_wait_s is None else min(REMOTE_CHECK_S, setup_wait_s)


def _unreachable(uri: str, seconds: float) -> str | None:
    """Why the tracking server at ``uri`` cannot take this call's run, or None when it answers.

    One request to its ``/health``, with MLflow's own credentials and TLS settings, no retry,
    ``seconds`` to connect and as much to answer: a refused connection fails at once and a
    server that accepts but never answers after ``seconds``, where MLflow's defaults (7
    retries, 120 s each) would hold every call for minutes. Any HTTP answer counts as up.
    """
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    try:
        http_request(
            get_default_host_creds(uri),
            "/health",
            "GET",
            max_retries=0,
            backoff_factor=0,
            timeout=seconds,
            raise_on_status=False,
        )
    except Exception as exc:  # noqa: BLE001 - whatever the cause, the server cannot be used now
        text = str(exc)
        if "refused" in text.lower():
            return "refused the connection"
        if "timed out" in text.lower() or "timeout" in text.lower():
            return f"did not answer within {seconds:g} s"
        return f"could not be reached ({text.splitlines()[0][:300]})"
    return None


def _say_untracked(uri: str, why: str, log_root: str | None) -> None:
    """One loud line: the call goes on, but MLflow will not have it."""
    print(
        f"air_magic: WARNING: the MLflow tracking server {uri} {why}: this call runs UNTRACKED "
        f"(its rank logs are kept under {log_root or paths.default_log_root()})",
        file=sys.stderr,
        flush=True,
    )


@contextlib.contextmanager
def _store_setup_lock(uri: str) -> Iterator[None]:
    """For the embedded store: one process at a time opens it (``flock`` on ``mlflow.db.lock``).

    Opening a sqlite store makes and migrates MLflow's tables when they are missing or old;
    processes doing that at once fail (``table latest_metrics already exists``,
    ``duplicate column name``). Each process opens a store once (MLflow caches it), so
    the lock is taken once per process, and is over in milliseconds once the tables exist.
    """
    if uri != paths.embedded_mlflow_uri():
        yield
        return
    path = os.path.join(paths.embedded_mlflow_dir(), paths.MLFLOW_DB_LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _tracking_uri(mlflow: Any, active: Any) -> str:
    from mlflow.tracking._tracking_service import utils

    user_configured = utils.is_tracking_uri_set()
    fluent = sys.modules.get("mlflow.tracking.fluent")
    experiment_set = getattr(fluent, "_active_experiment_id", None) is not None
    if user_configured or active is not None or experiment_set:
        return str(mlflow.get_tracking_uri())
    private_files.private_store(
        paths.embedded_mlflow_dir(), paths.MLFLOW_DB, [paths.MLFLOW_ARTIFACTS]
    )  # before MLflow opens it
    return paths.embedded_mlflow_uri()


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
    if uri == paths.embedded_mlflow_uri():
        # Keep artifacts beside the embedded store, not in whatever the cwd is.
        location = "file://" + os.path.join(paths.embedded_mlflow_dir(), paths.MLFLOW_ARTIFACTS, _safe(name))
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
