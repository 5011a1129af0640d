"""System metrics of a call: this machine's CPU, memory, disk, network and GPUs, in its MLflow run.

Started by :class:`~air_magic.tracking.run.TrackedRun` when the ranks start and
stopped before the run ends, on the run's owner thread. One sampler per call,
in the caller (never in a rank: eight ranks would log the same machine eight
times). It is MLflow's own monitor (``SystemMetricsMonitor``), so the keys are
MLflow's: ``system/cpu_utilization_percentage``,
``system/system_memory_usage_megabytes``, ``system/gpu_0_utilization_percentage``...
GPUs are read through NVML, which creates no CUDA context in the caller.
MLflow's own variables set the pace: ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL``
(seconds, 10 by default) and ``MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING``; a
call shorter than one interval logs none. Off: ``system_metrics=False``, or
``MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING=false``.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

THREAD_NAME = "air_magic-system-metrics"
# MLflow's monitor says what it does at INFO ("Started monitoring system metrics") and warns on
# every sample a GPU cannot answer (power, in many containers): not for the user's cell.
_MLFLOW_LOGGERS = (
    "mlflow.system_metrics.system_metrics_monitor",
    "mlflow.system_metrics.metrics.gpu_monitor",
    "mlflow.system_metrics.metrics.rocm_monitor",
    "mlflow.system_metrics.metrics.cpu_monitor",
    "mlflow.system_metrics.metrics.disk_monitor",
    "mlflow.system_metrics.metrics.network_monitor",
)


class _OursBelowError(logging.Filter):
    """Drop what MLflow's monitor logs below ERROR from air_magic's threads (the user's own
    monitors, on MLflow's threads, keep their messages)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not (record.threadName or "").startswith("air_magic")


_FILTER = _OursBelowError()


def wanted(setting: bool) -> bool:
    """The call's ``system_metrics`` setting, unless MLflow's own switch says off."""
    off = os.environ.get("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "").strip().lower() in ("false", "0", "no")
    return setting and not off


def start(run_id: str, tracking_uri: str, resumed: bool) -> Any:
    """Start sampling into ``run_id``; the monitor, for :func:`stop`. Call it on the owner thread."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    for name in _MLFLOW_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    if "tracking_uri" not in inspect.signature(SystemMetricsMonitor).parameters:
        # Older MLflow's monitor writes to the process's global tracking URI, which the call's
        # store (the embedded one, say) need not be: it would fail quietly, or write elsewhere.
        raise RuntimeError("this MLflow's SystemMetricsMonitor cannot be told the store (MLflow 3 can)")
    monitor = SystemMetricsMonitor(run_id, resume_logging=resumed, tracking_uri=tracking_uri)
    monitor.start()
    thread = getattr(monitor, "_process", None)
    if thread is not None:
        thread.name = THREAD_NAME  # its messages are ours to quiet (see _OursBelowError)
    return monitor


def stop(monitor: Any) -> None:
    """Stop sampling and write what was sampled (before the run ends: MLflow's monitor stops on
    its own once the run is no longer RUNNING, and would lose its last samples)."""
    monitor.finish()
