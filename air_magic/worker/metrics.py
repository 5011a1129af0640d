"""Inside a rank: ``mlflow.log_metric`` / ``log_metrics`` cost microseconds, not a database write.

MLflow's fluent calls insert one row per call (about 4.5 ms on a sqlite store,
and every rank queues on the one database lock). When the rank imports
``mlflow.tracking.fluent``, :func:`patch_fluent` (called by ``mlflow_hook``'s
import hook) wraps both functions: a metric for the call's shared run is
validated exactly as MLflow validates it, stamped with the caller's step and
the time of the call, and appended as one line to
``<AIR_MAGIC_METRICS_DIR>/rank-<RANK>.tsv`` with a single ``write(2)``. The
caller's :class:`~air_magic.tracking.metric_writer.MetricWriter` is the one process
that writes those lines into the store, in batches (see metric_writer.py for
why a single writer).

Because each line reaches the file at the moment it is logged, a rank that is
killed (SIGKILL, timeout, interrupt) loses nothing it logged. Everything else
keeps MLflow's own path: another run, another tracking URI, ``synchronous=True``,
a model or dataset link, params, tags, artifacts. ``AIR_MAGIC_METRICS=direct``
turns the wrapping off.

The wrapping uses MLflow APIs that are not public (``_validate_metric``,
``RunOperations``, ``_get_or_start_run``; docs/architecture.md, "Private MLflow
APIs we depend on"). An MLflow without them, or with other signatures, keeps
its own path: metrics are slower, never lost, and rank 0 says so once.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import warnings
from types import ModuleType
from typing import Any

from air_magic.protocol import env_names, wire


def enabled() -> bool:
    return bool(
        os.environ.get(env_names.SHARED_RUN)
        and os.environ.get(env_names.METRICS_DIR)
        and os.environ.get(env_names.METRICS_MODE, "batched") != "direct"
    )


class _MetricFile:
    """The rank's metric file, opened on first use; one ``write(2)`` per call, so lines never interleave.

    A metric that cannot be written (a full or read-only temp folder, a quota) never ends the
    training: its rows are counted, the first failure is said once on the rank's stderr, and the
    count again as the rank exits (:func:`report_lost`). Writing is tried again at the next call,
    so rows logged after space returns are kept.
    """

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._torn = False  # a write stopped mid-line: the next one starts on a line of its own
        self.lost = 0  # rows not written
        self.error: OSError | None = None  # the first failure, as said

    def append(self, lines: str) -> None:
        with self._lock:  # one writer at a time: a torn line is repaired before the next
            try:
                # "\t\n": the torn fragment gets a fifth field, so it never parses as a (wrong) row.
                self._write(("\t\n" if self._torn else "") + lines)
                self._torn = False
            except OSError as exc:
                self._lost(lines.count("\n"), exc)

    def _write(self, text: str) -> None:
        if self._fd is None:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
            self._fd = os.open(self.path, flags, 0o600)
        data = text.encode()
        written = 0
        try:
            while written < len(data):  # a regular file takes it all, or fails part-way when full
                written += os.write(self._fd, data[written:])
        finally:
            if 0 < written < len(data):
                self._torn = True  # part of a line reached the file

    def _lost(self, rows: int, exc: OSError) -> None:
        self.lost += rows
        if self.error is None:
            self.error = exc
            _files_with_losses.append(self)
            sys.stderr.write(
                f"[air_magic] metrics could not be written to {self.path} "
                f"({exc.strerror or exc}): the training goes on; rows that cannot be written are "
                "counted and the count is said when the rank ends\n"
            )


_files_with_losses: list[_MetricFile] = []


def report_lost() -> None:
    """Said as the rank ends: how many metric rows could not be written, and why (nothing if none)."""
    for sink in _files_with_losses:
        error = sink.error.strerror if sink.error is not None else "error"
        sys.stderr.write(f"[air_magic] {sink.lost} metric row(s) were not stored: {sink.path}: {error}\n")


_own_file: _MetricFile | None = None


def append(metrics: dict[str, float], step: int) -> bool:
    """Metrics of air_magic's own (the data loader's timings) for the call's run, without MLflow.

    The same lines the wrapped ``log_metrics`` writes, so the caller's writer batches
    them; a rank that never imports mlflow pays nothing for it. False (nothing
    written) when the call is not tracked.
    """
    global _own_file
    if not enabled():
        return False
    if _own_file is None:
        metrics_dir = os.environ[env_names.METRICS_DIR]
        _own_file = _MetricFile(wire.metrics_path(metrics_dir, os.environ.get("RANK", "0")))
    timestamp = int(time.time() * 1000)
    lines = (wire.metric_line(key, value, timestamp, step) for key, value in metrics.items())
    _own_file.append("".join(lines))
    return True


def _batching_supported() -> bool:
    """This MLflow has the private pieces batched logging uses, called as we call them (else: said once)."""
    import inspect  # here, not above: a rank that never imports mlflow must not pay for it

    try:
        from mlflow.environment_variables import MLFLOW_ENABLE_ASYNC_LOGGING  # noqa: F401
        from mlflow.utils.async_logging.run_operations import RunOperations
        from mlflow.utils.validation import _validate_metric

        inspect.signature(_validate_metric).bind("key", 0.0, 0, 0)  # called so in patch_fluent
        RunOperations([])  # made so in patch_fluent: a finished operation
    except (ImportError, TypeError, ValueError) as exc:
        if os.environ.get("RANK", "0") == "0":  # once per call, not once per rank
            warnings.warn(
                f"air_magic: this MLflow lacks what batched metric logging uses ({exc}); "
                "metrics take MLflow's own (slower) path",
                RuntimeWarning,
                stacklevel=3,
            )
        return False
    return True


def patch_fluent(fluent: ModuleType) -> None:
    """Route the fluent metric calls for the shared run through the rank's metric file."""
    if not enabled():
        return
    if not _batching_supported():
        return
    from mlflow.environment_variables import MLFLOW_ENABLE_ASYNC_LOGGING
    from mlflow.tracking import get_tracking_uri
    from mlflow.utils.async_logging.run_operations import RunOperations
    from mlflow.utils.validation import _validate_metric

    shared = os.environ[env_names.SHARED_RUN]
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    sink = _MetricFile(wire.metrics_path(os.environ[env_names.METRICS_DIR], os.environ.get("RANK", "0")))
    direct_metric, direct_metrics = fluent.log_metric, fluent.log_metrics
    get_or_start = getattr(fluent, "_get_or_start_run", fluent.active_run)
    active_model = getattr(fluent, "get_active_model_id", lambda: None)  # MLflow 3; absent in 2.x

    def for_us(synchronous: Any, run_id: Any, model_id: Any, dataset: Any) -> bool:
        if synchronous or model_id is not None or dataset is not None:
            return False  # the caller asked for MLflow's own behaviour, or a link we do not carry
        if run_id is not None and run_id != shared:
            return False
        if uri and get_tracking_uri() != uri:
            return False  # the rank's code pointed MLflow at another store
        active = get_or_start()  # as MLflow does: resumes the shared run after an end_run()
        if active is None or active.info.run_id != shared:
            return False  # the rank's code started a run of its own
        return active_model() is None

    def record(metrics: dict[str, Any], step: int | None, timestamp: int | None, synchronous: Any) -> Any:
        timestamp = timestamp or int(time.time() * 1000)
        step = step or 0
        lines = []
        for key, value in metrics.items():
            _validate_metric(key, value, timestamp, step)  # the same error, at the user's line
            lines.append(wire.metric_line(key, value, timestamp, step))
        sink.append("".join(lines))
        asynchronous = synchronous is False or (synchronous is None and MLFLOW_ENABLE_ASYNC_LOGGING.get())
        return RunOperations([]) if asynchronous else None  # what MLflow returns, already complete

    @functools.wraps(direct_metric)
    def log_metric(
        key: str,
        value: float,
        step: int | None = None,
        synchronous: bool | None = None,
        timestamp: int | None = None,
        run_id: str | None = None,
        model_id: str | None = None,
        dataset: Any = None,
    ) -> Any:
        if not for_us(synchronous, run_id, model_id, dataset):
            given = _given(step=step, synchronous=synchronous, timestamp=timestamp, run_id=run_id)
            return direct_metric(key, value, **given, **_given(model_id=model_id, dataset=dataset))
        return record({key: value}, step, timestamp, synchronous)

    @functools.wraps(direct_metrics)
    def log_metrics(
        metrics: dict[str, float],
        step: int | None = None,
        synchronous: bool | None = None,
        run_id: str | None = None,
        timestamp: int | None = None,
        model_id: str | None = None,
        dataset: Any = None,
    ) -> Any:
        if not for_us(synchronous, run_id, model_id, dataset):
            given = _given(step=step, synchronous=synchronous, run_id=run_id, timestamp=timestamp)
            return direct_metrics(metrics, **given, **_given(model_id=model_id, dataset=dataset))
        return record(metrics, step, timestamp, synchronous)

    package = sys.modules.get("mlflow")
    for name, ours, theirs in (
        ("log_metric", log_metric, direct_metric),
        ("log_metrics", log_metrics, direct_metrics),
    ):
        setattr(fluent, name, ours)
        # Normally the hook runs before ``mlflow/__init__`` binds these names; when mlflow was
        # imported before the rank started (a warm starter preloading it), rebind them here.
        if package is not None and getattr(package, name, None) is theirs:
            setattr(package, name, ours)


def _given(**arguments: Any) -> dict[str, Any]:
    """The arguments the user passed: MLflow 2.x's functions take fewer keywords than 3.x's."""
    return {name: value for name, value in arguments.items() if value is not None}
