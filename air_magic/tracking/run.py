"""MLflow: one run per call, created in the caller before launch, ended truthfully after.

- **Where.** The store (tracking URI) and the experiment: :mod:`~air_magic.tracking.store`.
  A remote (http/https) server gets bounded waits and a quick health check first:
  :mod:`~air_magic.tracking.remote`.
- **Nesting.** With an active run in the notebook, the call's run is its child.
- **Ranks** get ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_ID`` and
  ``MLFLOW_RUN_ID``; ``worker/mlflow_hook.py`` keeps a rank from ending or renaming the
  shared run, and makes a run a rank starts for itself a child of it. A call that runs
  untracked gives them :data:`~air_magic.tracking.remote.UNTRACKED_RANK_URI` instead, which
  each rank turns into a throwaway sqlite file in its call folder, never the store that failed.
- **Untracked, not failed.** Any failure to set the run up (a server down, one that is not
  MLflow, a read-only embedded store) runs the call untracked with one line; air_magic's own
  refusals (:class:`~air_magic.errors.ConfigurationError`) still fail it.
- **Metrics** a rank logs with ``mlflow.log_metric``/``log_metrics`` go through
  a file to this process's :class:`~air_magic.tracking.metric_writer.MetricWriter`, which
  writes them in batches (``AIR_MAGIC_METRICS=direct``: MLflow's own path).
- **Recorded:** launch parameters, the function's or cell's source, every
  rank's log, the outcome; status FINISHED, FAILED (rank failure, timeout) or
  KILLED (interrupt), set in a ``finally``. Runs the ranks started under it and
  left RUNNING (a killed rank) end with it.
- **Never recorded:** a value given in ``env=`` (:attr:`CallFacts.hidden`): the source
  (whose decorator line may hold it), the parameters, the tags and the run name show
  :data:`HIDDEN` in its place (what the user's code itself prints is logged as printed).
- **Never on the caller's thread.** ``import mlflow`` and every MLflow request
  run on helper threads (:func:`~air_magic.tracking.mlflow_import.import_mlflow`,
  :class:`TrackedRunOwner`); the caller's thread only waits. So an interrupt at any
  moment stops a wait, never an import half-way (which would break every later
  call) nor the run's end (which would leave it RUNNING).

The call layer (``calls/call.py``) describes the call in a :class:`CallFacts`,
waits on a :class:`TrackedRunOwner`, and hands the :class:`TrackedRun` it gives the
launch events and, in a ``finally``, the call's outcome.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import math
import os
import platform
import queue
import re
import shutil
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from air_magic import paths, private_files
from air_magic._version import __version__
from air_magic.errors import ConfigurationError
from air_magic.launch.accelerators import AcceleratorPlan
from air_magic.protocol import env_names
from air_magic.protocol.events import Event, Outcome, RankMetrics, RecordLink, RunFinished, RunStarted
from air_magic.threads import start_in_context
from air_magic.tracking import log_upload, metric_writer, remote, resume, store, system_metrics
from air_magic.tracking.log_upload import LogUploader
from air_magic.tracking.metric_rows import short_error
from air_magic.tracking.metric_writer import MetricWriter
from air_magic.tracking.mlflow_import import import_mlflow

# At interpreter exit: how long runs still open get to be ended (as long as a remote server gets).
AT_EXIT_WAIT_S = 30.0
# The error's first line as a tag, cut below MLflow's cap on a tag's value (5000 in 2.x, 8000 in 3.x).
ERROR_TAG_CHARS = 4000
# Child runs the ranks left RUNNING, ended with the call: one search, MLflow's largest page of runs
# (a call has one child per rank at most, unless the ranks start many runs of their own).
CHILD_SEARCH_LIMIT = 1000
# A run's name, cut below MLflow's limit for it (a 250-character column).
RUN_NAME_CHARS = 200
_live: list[TrackedRun] = []  # runs of this process not yet ended (for atexit)
_unended: list[TrackedRun] = []  # runs whose end the store refused (TrackedRun._end): tried again


@dataclass
class TrackedRun:
    """The MLflow run of one call. A consumer of launch events, and ended by :meth:`finish`.

    Its MLflow work runs on its owner thread (:meth:`serve`, see :class:`TrackedRunOwner`), in order;
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
    outcome: str | None = None  # the call's RunFinished's
    error: str | None = None
    metrics: MetricWriter | None = None
    jobs: queue.SimpleQueue[Callable[[], object] | str] = field(default_factory=queue.SimpleQueue, repr=False)
    end_wait_s: float | None = None  # how long the caller waits for the run's end (None: until it is done)
    ended: threading.Event = field(default_factory=threading.Event, repr=False)
    logs_path: str = "logs"  # where the logs go in the run: logs/call-N when a resumed run's Nth call
    resumed: bool = False  # an existing run (run_id=, MLFLOW_RUN_ID) this call continues
    sample_system: bool = False  # system metrics (tracking/system_metrics.py) from the ranks' start
    _monitor: Any = field(default=None, repr=False)
    _uploader: LogUploader | None = field(default=None, repr=False)
    _next_upload: float = field(default=math.inf, repr=False)  # time.monotonic() of the next pass

    def describe(self) -> str:
        from air_magic.tracking import ui as mlflow_ui

        where = (
            self.url
            or f"{self.tracking_uri} (to open it: {mlflow_ui.open_command(self.tracking_uri, self.run_id)})"
        )
        return f"MLflow run {self.run_id} in experiment {self.experiment_id}: {where}"

    def link(self) -> RecordLink:
        """The run as displays show it."""
        return RecordLink(run_id=self.run_id, description=self.describe(), url=self.url)

    def handle(self, event: Event) -> None:
        if isinstance(event, RunStarted):
            self.log_dir = event.log_dir
            # The call's id, under the tag's name as it was (earlier runs have it).
            tag = functools.partial(self.client.set_tag, self.run_id, "air_magic.run_id", event.call_id)
            self.jobs.put(tag)
            self.jobs.put(self._watch)
            if self.metrics is not None:
                self.metrics.start()
        elif isinstance(event, RankMetrics):
            if self.metrics is not None:
                self.metrics.append(event.rank, event.data)
        elif isinstance(event, RunFinished):
            self.failed_rank = event.failed_rank
            self.error = event.error
            self.outcome = event.outcome

    def serve(self) -> None:
        """The owner thread: run the queued MLflow work in order; the call's outcome is the last job.

        Between jobs it copies the rank logs into the run every ``log_upload.UPLOAD_EVERY_S``."""
        while True:
            try:
                wait = (
                    None if self._next_upload == math.inf else max(0.0, self._next_upload - time.monotonic())
                )
                job = self.jobs.get(timeout=wait)
            except queue.Empty:
                self._upload_logs()
                continue
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
                _warn(f"MLflow run {self.run_id}: {short_error(exc)}")

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

    def _watch(self) -> None:
        """The ranks have started: sample the machine and follow the logs (on the owner thread)."""
        if self.sample_system:
            try:
                self._monitor = system_metrics.start(self.run_id, self.tracking_uri, self.resumed)
            except Exception as exc:  # noqa: BLE001 - the call's own record matters more
                _warn(f"system metrics are not recorded for MLflow run {self.run_id}: {short_error(exc)}")
        if self.log_dir:
            self._uploader = self._new_uploader(self.log_dir)
            self._next_upload = time.monotonic() + self._upload_every_s()

    def _new_uploader(self, log_dir: str) -> LogUploader:
        private = self.tracking_uri == paths.embedded_mlflow_uri()
        return LogUploader(self.client, self.run_id, log_dir, self.logs_path, private)

    def _upload_every_s(self) -> float:
        remote = self._uploader is not None and self._uploader.remote
        return log_upload.REMOTE_UPLOAD_EVERY_S if remote else log_upload.UPLOAD_EVERY_S

    def _upload_logs(self) -> None:
        self._next_upload = time.monotonic() + self._upload_every_s()
        if self._uploader is None:
            return
        try:
            self._uploader.upload()
        except Exception as exc:  # noqa: BLE001 - tried again at the next pass, and at the end
            _warn(f"could not copy the logs into MLflow run {self.run_id} yet: {short_error(exc)}")

    def _close_metrics(self) -> int:
        """The ranks' last rows into the store; the rows it did not take."""
        return self.metrics.close() if self.metrics is not None else 0

    def _drop_metrics(self) -> None:
        """The run is stored whole: its metric folder goes."""
        metrics, self.metrics = self.metrics, None
        if metrics is not None:
            shutil.rmtree(metrics.directory, ignore_errors=True)

    def _end(self, outcome: str) -> bool:
        """Write what is left and end the run with the status that matches ``outcome``; False when
        the store refused part of it (a full disk, a server down): then the run is kept in
        :data:`_unended`, and the process's next tracked call tries again (:func:`end_unended`).
        Never raises.

        The call's RunFinished, when it came, says the outcome: the one its history line says (a
        session's counts its cells' outcomes, calls/persistent.py)."""
        outcome = self.outcome = self.outcome or outcome
        refused: list[str] = []
        left = self._close_metrics()  # every rank is gone: what they logged is all in the files
        if left:
            refused.append(self.metrics.last_error if self.metrics and self.metrics.last_error else "")
        if self._monitor is not None:
            monitor, self._monitor = self._monitor, None
            with contextlib.suppress(Exception):  # never keeps the run from ending
                system_metrics.stop(monitor)
        self._end_children(outcome)
        tags = {"air_magic.outcome": outcome}
        if self.failed_rank is not None:
            tags["air_magic.failed_rank"] = str(self.failed_rank)
        if self.error:
            tags["air_magic.error"] = self.error.splitlines()[0][:ERROR_TAG_CHARS]
        try:
            for key, value in tags.items():
                self.client.set_tag(self.run_id, key, value)
            if self.log_dir and os.path.isdir(self.log_dir):
                if self._uploader is None:
                    self._uploader = self._new_uploader(self.log_dir)
                self._uploader.upload()  # what is new since the last pass
            if (
                self.tracking_uri == paths.embedded_mlflow_uri()
            ):  # MLflow makes them with the umask: 0644 files
                private_files.make_run_artifacts_private(
                    self.client, self.run_id, paths.embedded_mlflow_dir()
                )
        except Exception as exc:  # noqa: BLE001 - the run must still be ended below
            refused.append(short_error(exc))
        try:
            # Rows still unstored: the run stays RUNNING, so that whichever process stores them
            # ends it (end_unended here; store.end_orphaned_runs in a later process, which looks
            # only at runs left RUNNING). A run ended now would keep its rows out for good.
            if not left:
                self.client.set_terminated(self.run_id, store.terminal_status(outcome))
        except Exception as exc:  # noqa: BLE001 - never hide the call's own outcome
            refused.append(short_error(exc))
        if not refused:
            self._drop_metrics()
            if self in _unended:
                _unended.remove(self)
            return True
        if self not in _unended:
            _unended.append(self)
            if self.metrics is not None:  # if this process ends first, the next one ends the run
                metric_writer.keep_outcome(self.metrics.directory, outcome)
            why = next((r for r in refused if r), "the store refused it")
            folder = self.metrics.directory if self.metrics is not None else "?"
            kept = f"; {left} metric row(s) it did not take wait in {folder}" if left else ""
            _warn(
                f"MLflow run {self.run_id} could not be stored whole ({why}){kept}. The call itself "
                f"{outcome}; the next tracked call into this store (this process's, or a later "
                "one's) stores the rest and ends the run"
            )
        return False

    def end_again(self) -> bool:
        """An earlier try of :meth:`_end` was refused: try again (on the owner thread of a later call)."""
        assert self.outcome is not None
        return self._end(self.outcome)

    def _end_children(self, outcome: str) -> None:
        """End the runs that ranks started under this one and left RUNNING (see worker/mlflow_hook.py).

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
                max_results=CHILD_SEARCH_LIMIT,
            )
            for child in children:
                self.client.set_terminated(child.info.run_id, store.terminal_status(outcome))
        except Exception as exc:  # noqa: BLE001 - the call's own run must still be ended
            _warn(
                f"could not end the runs the ranks started under MLflow run {self.run_id}: {short_error(exc)}"
            )


@dataclass(frozen=True)
class CallFacts:
    """What the call's run records of the call (known before anything launches)."""

    name: str
    kind: str  # 'function' or 'cell'; from the command line also 'script' or 'module'
    source: str | None
    plan: AcceleratorPlan
    timeout: float | None
    accelerator_type: str | None
    experiment: str | None
    run_name: str | None
    resume_run_id: str | None = None  # run_id=: an existing MLflow run to continue (tracking/resume.py)
    system_metrics: bool = True
    hidden: tuple[str, ...] = ()  # values of env=: never in the source, a param, a tag (:func:`redact`)


HIDDEN = "***"  # what the recorded source, params and tags show where a value of env= was
# A value shorter than this is no secret ("1", "gloo"), and hiding it would garble the source.
HIDDEN_MIN_CHARS = 4


def redact(text: str, hidden: tuple[str, ...]) -> str:
    """``text`` with every occurrence of each of ``hidden`` (of :data:`HIDDEN_MIN_CHARS` or more)
    replaced by :data:`HIDDEN`; the longest first, so that one value inside another goes whole."""
    for value in sorted({v for v in hidden if len(v) >= HIDDEN_MIN_CHARS}, key=len, reverse=True):
        text = text.replace(value, HIDDEN)
    return text


_NOT_READ = object()


class TrackedRunOwner:
    """Creates the call's run on an owner thread, which then does all of the run's MLflow work.

    Why a thread: nothing MLflow does may run on the caller's thread. There, an interrupt
    (Ctrl-C, the notebook's stop button) lands wherever the code happens to be: half-way
    through an import (leaving half-initialised modules that break every later call), or
    between creating the run and the ``try`` that ends it (leaving it RUNNING). Here the
    caller's thread only waits, and an interrupt only stops the wait: the owner thread finishes
    what it was doing, and :meth:`end`'s outcome ends the run, even one created after the
    interrupt (one not yet begun is not created). A wait on a thread can also be bounded: a
    remote server gets :func:`~air_magic.tracking.remote.setup_wait_s`, then the call runs untracked.
    """

    def __init__(self, call: CallFacts, log_root: str | None = None):
        # Imported on the caller's thread, before its end: ``import mlflow`` on the owner thread
        # imports it, which registers a threading exit hook, refused once the main thread has
        # ended (a script that starts a background run and ends: its run must still be made and
        # ended KILLED by calls/background.cancel_all). Standard library, already loaded mostly.
        import concurrent.futures.thread  # noqa: F401

        self._call = call
        self._timeout = call.timeout
        self._log_root = log_root
        self._jobs: queue.SimpleQueue[Callable[[], object] | str] = queue.SimpleQueue()
        self._uri_known = threading.Event()
        self._ready = threading.Event()  # the run exists, or will not be made
        self.uri = ""
        self._tracked: TrackedRun | None = None
        self._unreachable: str | None = None  # why the call runs untracked
        # The ranks' MLflow variables when the call runs untracked (calls/call.py gives them).
        self.untracked_env: dict[str, str] = {}
        self._error: BaseException | None = None
        self._active: Any = _NOT_READ

    @property
    def tracked(self) -> TrackedRun | None:
        """The call's run once it exists (None before, or when untracked)."""
        return self._tracked

    def remember_active(self, active: Any = _NOT_READ) -> None:
        """Read the caller's active MLflow run now, on the caller's thread (a background call waits
        for its run on another), or take ``active`` (a detached run's supervisor gets its caller's).
        Without mlflow imported there can be no active run."""
        if active is _NOT_READ:
            mlflow = sys.modules.get("mlflow")
            if mlflow is not None and getattr(getattr(mlflow, "__spec__", None), "_initializing", False):
                return  # still being imported (or an interrupted import): wait() reads it, later
            active_run = getattr(mlflow, "active_run", None)
            active = active_run() if callable(active_run) else None
        self._active = active

    @property
    def remembered_active(self) -> Any:
        """The active run :meth:`remember_active` read (None if none, or not read)."""
        return None if self._active is _NOT_READ else self._active

    def wait(self) -> TrackedRun | None:
        """The call's run, or None: mlflow not installed, or the tracking server not answering."""
        mlflow = import_mlflow()
        if mlflow is None:
            return None
        # MLflow keeps the active run per thread: read it on the caller's (remember_active() did,
        # for a call that waits here on a thread of its own).
        active = self._active if self._active is not _NOT_READ else mlflow.active_run()
        # What MLflow prints (creating a new store, say) goes to the cell of the call (threads.py).
        start_in_context(self._own, "air_magic-run", mlflow, active)
        self._uri_known.wait()
        limit = remote.setup_wait_s(self.uri, self._timeout)
        if not self._ready.wait(limit):
            self._jobs.put("untracked")  # the run, when it comes, is ended at once
            self._go_untracked(f"did not create this call's run within {limit:g} s")
            return None
        if self._error is not None:
            raise self._error
        if self._unreachable is not None:
            self._go_untracked(self._unreachable)
        return self._tracked

    def _go_untracked(self, why: str) -> None:
        """The call runs without its run: one line says why, and the ranks' own MLflow calls are
        pointed away from the store that failed (:data:`~air_magic.tracking.remote.UNTRACKED_RANK_URI`)."""
        self.untracked_env = {"MLFLOW_TRACKING_URI": remote.UNTRACKED_RANK_URI}
        remote.say_untracked(self.uri, why, self._log_root)

    def end(self, outcome: str) -> None:
        """End the call's run with ``outcome``: now, or as soon as it exists. Call it in a ``finally``."""
        self._jobs.put(outcome)
        tracked = self._tracked
        if tracked is not None:
            tracked.finish(outcome)

    def _own(self, mlflow: Any, active: Any) -> None:
        """The owner thread: find the store, create the run, then do its work until its end."""
        try:
            self.uri = store.chosen_uri(mlflow, active)
            self._uri_known.set()
            if remote.is_remote(self.uri):
                check_s = remote.check_s(remote.setup_wait_s(self.uri, self._timeout))
                self._unreachable = remote.unreachable(self.uri, check_s)
            else:
                self._unreachable = store.unusable(self.uri)
            if self._unreachable is None:
                self._tracked = _create_run(self.uri, active, self._jobs, self._call)
        except ConfigurationError as exc:  # a refusal of ours (a store folder others can write, run_id=)
            self._error = exc
        except Exception as exc:  # noqa: BLE001 - any other failure to set the run up: untracked
            # (a server that answers but is not MLflow, a store that cannot be written...)
            self._unreachable = _setup_failed(exc)
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            self._error = exc
        finally:
            self._uri_known.set()
            self._ready.set()
        if self._tracked is not None:
            self._tracked.serve()


def _create_run(
    uri: str, active: Any, jobs: queue.SimpleQueue[Callable[[], object] | str], call: CallFacts
) -> TrackedRun | None:
    """Create the call's run (on its owner thread); None when the call ended before it began."""
    from mlflow.tracking import MlflowClient

    store.quiet_store_errors()
    with store.setup_lock(uri):
        client = MlflowClient(tracking_uri=uri)
    resume_id = resume.run_to_resume(call.resume_run_id, active)
    if resume_id is not None:
        store.end_orphaned_runs(client, uri)  # before the run to resume is checked (it may be one)
        end_unended(uri)
        if not jobs.empty():
            return None
        return _track(client, uri, jobs, call, resume.reopen(client, uri, resume_id, call.experiment))
    # The experiment first: a store that cannot take the run (a web server that is not MLflow's)
    # fails here, and the call runs untracked without a warning from the upkeep below too.
    experiment_id = store.experiment_id(client, uri, active, call.experiment)
    store.end_orphaned_runs(client, uri)
    end_unended(uri)
    tags = {
        "mlflow.source.name": redact(call.name, call.hidden),
        "mlflow.source.type": "NOTEBOOK" if call.kind == "cell" else "LOCAL",
    }
    tags["air_magic.kind"] = call.kind
    tags["air_magic.host"] = socket.gethostname()
    tags["air_magic.caller"] = store.caller_id()
    if active is not None and active.info.experiment_id == experiment_id:
        tags["mlflow.parentRunId"] = active.info.run_id
    if not jobs.empty():
        return None  # the call was interrupted while its run was being prepared: nothing to record
    run_name = redact(call.run_name or _run_name(call.name), call.hidden)
    # Not the internal tags (host, caller, parent run): code reads them back, and a short env=
    # value (a port) could match inside them. The source name is redacted above.
    run = client.create_run(experiment_id, run_name=run_name, tags=tags)
    return _track(client, uri, jobs, call, resume.Reopened(run.info.run_id, experiment_id, 1, existing=False))


def _track(
    client: Any,
    uri: str,
    jobs: queue.SimpleQueue[Callable[[], object] | str],
    call: CallFacts,
    run: resume.Reopened,
) -> TrackedRun:
    """The call's run (new, or reopened), described and ready for the call."""
    end_wait_s = remote.REMOTE_END_S if remote.is_remote(uri) else None
    tracked = TrackedRun(
        client, run.run_id, run.experiment_id, uri, None, {}, jobs=jobs, end_wait_s=end_wait_s
    )
    tracked.resumed = run.existing
    tracked.logs_path = "logs" if run.call_number == 1 else f"logs/call-{run.call_number}"
    tracked.sample_system = system_metrics.wanted(call.system_metrics)
    _live.append(tracked)
    try:
        if tracked.resumed:
            tags = {
                "air_magic.calls": str(run.call_number),
                "air_magic.kind": call.kind,
                "air_magic.host": socket.gethostname(),
                "air_magic.caller": store.caller_id(),
            }
            for key, value in tags.items():
                client.set_tag(run.run_id, key, value)
        _describe_call(tracked, call, run)
    except BaseException:
        jobs.put("untracked")  # the run exists: end it now; the call goes on without it
        tracked.serve()
        raise
    return tracked


def _describe_call(tracked: TrackedRun, call: CallFacts, run: resume.Reopened) -> None:
    """Log the call's parameters and source; give the ranks their environment and the metric writer."""
    client, run_id, uri = tracked.client, tracked.run_id, tracked.tracking_uri
    experiment_id = tracked.experiment_id
    params = {
        "world_size": call.plan.world_size,
        "backend": call.plan.backend,
        "accelerators": call.plan.detected,
        "accelerator_type": call.accelerator_type or "auto",
        "timeout_s": "none" if call.timeout is None else f"{call.timeout:g}",
        {"function": "function", "cell": "cell"}.get(call.kind, "target"): call.name,
        "air_magic_version": __version__,
        "torch_version": _version("torch"),
        "python_version": platform.python_version(),
    }
    from mlflow.entities import Param

    # A resumed run keeps its parameters (MLflow never changes one): what this call does
    # differently goes in beside them, under its call number.
    fresh = {}
    for key, raw in params.items():
        value = redact(str(raw), call.hidden)
        if key not in run.params:
            fresh[key] = value
        elif run.params[key] != value:
            fresh[f"call-{run.call_number}.{key}"] = value
    if fresh:
        client.log_batch(run_id, params=[Param(k, v) for k, v in fresh.items()])
    if call.source:
        folder = "source" if run.call_number == 1 else f"source/call-{run.call_number}"
        # The source's decorator line (or a cell's magic line) may hold a secret given in env=.
        source = redact(call.source, call.hidden)
        client.log_text(run_id, source, f"{folder}/{store.safe_name(call.name)}.py")
    env = {
        "MLFLOW_TRACKING_URI": uri,
        "MLFLOW_EXPERIMENT_ID": experiment_id,
        "MLFLOW_RUN_ID": run_id,
        env_names.SHARED_RUN: run_id,
    }
    metrics = None
    if os.environ.get(env_names.METRICS_MODE, "batched") != "direct":
        metrics = MetricWriter(client, run_id, private_files.private_tempdir(paths.METRICS_KIND))  # 0700
        env[env_names.METRICS_DIR] = metrics.directory
    tracked.url = _link(uri, experiment_id, run_id)
    tracked.env = env
    tracked.metrics = metrics


def _setup_failed(exc: BaseException) -> str:
    """Why setting the call's run up failed, in one short line (MLflow's errors can carry a whole
    HTML page or a traceback)."""
    return f"could not take this call's run ({short_error(exc)})"


def _link(uri: str, experiment_id: str, run_id: str) -> str | None:
    """The run's address for a browser (None: the text names the command that opens it)."""
    from air_magic.tracking import ui as mlflow_ui

    try:
        return mlflow_ui.run_url(uri, experiment_id, run_id)
    except Exception as exc:  # noqa: BLE001 - a UI that cannot start must never stop the call
        _warn(f"the MLflow UI could not be started, so the run has no link: {exc}")
        return None


def end_unended(uri: str) -> None:
    """The runs of this process in ``uri`` whose end the store refused (a full disk, a server
    down), stored and ended now if it takes them: no run is left RUNNING once a later call runs
    while the store has room. Called on the owner thread of a call that tracks into ``uri``."""
    for tracked in [t for t in _unended if t.tracking_uri == uri]:
        if tracked.end_again():
            _warn(f"MLflow run {tracked.run_id} of an earlier call is stored whole now, and ended")


def end_live_runs() -> None:
    """A caller that exits in an orderly way mid-call (kernel shutdown) ends its runs as KILLED.

    Called at interpreter exit by the call layer, after the ranks are stopped (calls/call.py)."""
    for tracked in list(_live):
        tracked.finish(Outcome.INTERRUPTED, wait_s=AT_EXIT_WAIT_S)


def _run_name(name: str) -> str:
    return re.sub(r"[^\w.\- \[\]]", "_", name)[:RUN_NAME_CHARS]


def _version(package: str) -> str:
    # The distribution's metadata, not an import: torch takes seconds to import.
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _warn(message: str) -> None:
    with contextlib.suppress(Exception):
        warnings.warn(f"air_magic: {message}", RuntimeWarning, stacklevel=3)
