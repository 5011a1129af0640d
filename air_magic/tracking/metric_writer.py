"""In the caller: the one writer of the ranks' metrics into the call's MLflow run.

Ranks append each ``mlflow.log_metric`` as a line to their own file
(worker/metrics.py). A thread here reads the new complete lines of every file
each :data:`INTERVAL_S` and writes them through the store's sink
(``tracking/metric_rows.py``: straight into MLflow's tables of a sqlite store,
else ``MlflowClient.log_batch``); :meth:`MetricWriter.close` does a last pass
after the ranks are gone, before the run is ended.

Why one writer in the caller rather than each rank batching for itself:

- the ranks do no database work at all: no SQL on the training thread's GIL,
  no connection per rank, no lock queue on a sqlite store however many ranks;
- a line is in the file the moment it is logged, so a SIGKILLed, timed-out or
  interrupted rank loses nothing; a rank-side buffer loses its last interval;
- the measurements are in docs/benchmarks.md ("Metrics").

Lines that cannot be written (the store is down) are kept and retried on the
next pass; what is still unwritten at the end is reported in one warning.

A caller killed mid-call (SIGKILL, a kernel restart, a detached run's supervisor)
leaves its metric folder behind with the rows it had not written yet. The folder
names its run (:data:`~air_magic.paths.METRICS_RUN_FILE`), and the next process
that ends that run as orphaned imports every row first (:func:`import_left_behind`,
called by ``store.end_orphaned_runs``; the embedded store ignores rows it already has).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Any

from air_magic import paths, private_files
from air_magic.threads import start_in_context
from air_magic.tracking import metric_rows

INTERVAL_S = 0.5  # metrics reach the store (and the UI) within about this much, plus a batch's write


class MetricWriter:
    def __init__(
        self,
        client: Any,
        run_id: str,
        directory: str,
        interval_s: float = INTERVAL_S,
        sink: metric_rows.Sink | None = None,
    ):
        self.client = client
        self.run_id = run_id
        self.directory = directory
        self.interval_s = interval_s
        self.written = 0
        self._offsets: dict[str, int] = {}
        self._partial: dict[str, bytes] = {}
        self._pending: list[metric_rows.Row] = []
        self._sink = sink  # else chosen at the first write (which imports MLflow)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one pass at a time: the thread's and close()'s
        self._warned = False
        self._thread: threading.Thread | None = None
        with contextlib.suppress(OSError):  # for an import after a kill; a full disk costs only that
            fd = os.open(os.path.join(directory, paths.METRICS_RUN_FILE), os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.write(fd, run_id.encode())
            finally:
                os.close(fd)

    def start(self) -> None:
        if self._thread is None:
            self._thread = start_in_context(self._loop, "air_magic-metrics")  # its warnings: the call's cell

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._safe_pass()

    def _safe_pass(self) -> bool:
        try:
            return self.write_pass()
        except Exception as exc:  # noqa: BLE001 - this thread must live on; the error is said once
            self._warn(f"reading the ranks' metrics failed: {exc!r}")
            return False

    def close(self) -> None:
        """Stop the thread and write everything the ranks logged. Never raises."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        # A store that failed once may answer on a retry (a sqlite store busy for a moment);
        # 3 passes, back to back, give it that chance without holding the call's end for long
        # on a store that is down.
        for _ in range(3):
            if self._safe_pass() and not self._pending:
                break
        if self._pending:
            self._warned = False  # this one is always said
            self._warn(f"{len(self._pending)} metric(s) could not be written to MLflow run {self.run_id}")

    def write_pass(self) -> bool:
        """Read new lines and write them; False when the store refused a batch (they stay pending)."""
        with self._lock:
            for name in sorted(os.listdir(self.directory)) if os.path.isdir(self.directory) else []:
                if not name.endswith(".tsv"):
                    continue  # the run's name (METRICS_RUN_FILE)
                for line in self._new_lines(os.path.join(self.directory, name)):
                    try:
                        key, value, timestamp, step = line.split("\t")
                        self._pending.append((key, float(value), int(timestamp), int(step)))
                    except ValueError:
                        # A line's start names it in the warning; a garbled line may be long.
                        self._warn(f"skipped a line that is not a metric: {line[:80]!r}")
            while self._pending:
                if self._sink is None:
                    self._sink = metric_rows.sink_for(self.client, self.run_id)
                batch = self._pending[: self._sink.batch]
                try:
                    self._sink.write(batch)
                except Exception as exc:  # noqa: BLE001 - kept and retried; training goes on
                    self._warn(f"writing metrics to MLflow run {self.run_id} failed (will retry): {exc}")
                    return False
                del self._pending[: len(batch)]
                self.written += len(batch)
            return True

    def _new_lines(self, path: str) -> list[str]:
        """Complete lines added since the last pass (a line being written is left for the next)."""
        try:
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
        except FileNotFoundError:
            return []
        if not data:
            return []
        self._offsets[path] = self._offsets.get(path, 0) + len(data)
        data = self._partial.pop(path, b"") + data
        complete, _, rest = data.rpartition(b"\n")
        if rest:
            self._partial[path] = rest
        # errors="replace": a line torn inside a character (a full disk) is skipped, not the chunk.
        return complete.decode(errors="replace").split("\n") if complete else []

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            with contextlib.suppress(Exception):
                warnings.warn(f"air_magic: {message}", RuntimeWarning, stacklevel=2)


def import_left_behind(client: Any, run_id: str, folder: str | None = None) -> int:
    """Import the rows a dead caller's metric folders hold for ``run_id``, then remove those folders.

    Returns the rows found. Only folders whose owner is dead are read (a live caller's writer is
    still at work); each is read whole: the sqlite sink ignores rows the store already has.
    """
    found = 0
    for path in private_files.dead_callers_folders(paths.METRICS_KIND, folder):
        try:
            with open(os.path.join(path, paths.METRICS_RUN_FILE)) as f:
                if f.read().strip() != run_id:
                    continue
        except OSError:
            continue
        writer = MetricWriter(client, run_id, path)
        writer.write_pass()
        found += writer.written
        if not writer._pending:
            private_files.remove_tree(path)
    return found
