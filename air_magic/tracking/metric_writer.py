"""In the caller: the one writer of the ranks' metrics into the call's MLflow run.

Ranks append each ``mlflow.log_metric`` as a line to their own file
(worker/metrics.py); the lines of a rank on another node come as ``RankMetrics``
events, appended here to a copy of its file (:meth:`MetricWriter.append`). A
thread here reads the new complete lines of every file each :data:`INTERVAL_S`
and writes them through the store's sink (``tracking/metric_rows.py``: straight
into MLflow's tables of a sqlite store, else ``MlflowClient.log_batch``);
:meth:`MetricWriter.close` does a last pass after the ranks are gone, before the
run is ended.

Why one writer in the caller rather than each rank batching for itself:

- the ranks do no database work at all: no SQL on the training thread's GIL,
  no connection per rank, no lock queue on a sqlite store however many ranks;
- a line is in the file the moment it is logged, so a SIGKILLed, timed-out or
  interrupted rank loses nothing; a rank-side buffer loses its last interval;
- the measurements are in docs/benchmarks.md ("Metrics").

Lines that cannot be written (the store is down, its disk is full) stay where
they are, in the files, and are retried on the next pass: at most
:data:`MAX_PENDING` rows are held in memory, the rest are read when those are
written. What is still unstored at the end is counted (:meth:`MetricWriter.close`);
the folder is then kept, and the run's end is tried again at the process's next
tracked call (``tracking/run.py``).

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
from air_magic.protocol import wire
from air_magic.threads import start_in_context
from air_magic.tracking import metric_rows

INTERVAL_S = 0.5  # metrics reach the store (and the UI) within about this much, plus a batch's write
# While the store refuses rows, at most this many wait in memory (about 20 MB); the others wait in
# the ranks' files, read once these are written. A pass reads at most READ_BYTES of each file.
MAX_PENDING = 100_000
READ_BYTES = 8 << 20


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
        self._warned: set[str] = set()  # the kinds of trouble said already (once each)
        self.last_error: str | None = None  # the store's last refusal, in one line
        self._thread: threading.Thread | None = None
        self._copies: dict[int, int] = {}  # rank -> our copy of another node's rank file (append())
        # rank -> its copy ends inside a line (bytes of it written, not its newline): a failed write
        # there leaves a line whose rest is lost, which must never join the next bytes' line.
        self._unended: set[int] = set()  # ranks whose copy may end in a torn line: end it first
        self._torn: set[int] = set()  # ranks whose next bytes continue a lost line: skip to its end
        with contextlib.suppress(OSError):  # for an import after a kill; a full disk costs only that
            fd = os.open(os.path.join(directory, paths.METRICS_RUN_FILE), os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.write(fd, run_id.encode())
            finally:
                os.close(fd)

    def append(self, rank: int, data: bytes) -> None:
        """New lines of a rank on another node (the ``RankMetrics`` event): into our copy of its
        file, read by the passes like a local rank's. A disk too full to keep them costs those
        rows, said once; never an error of the call."""
        ends_a_line = data.endswith(b"\n")  # the bytes after these begin a line
        try:
            fd = self._copies.get(rank)
            if fd is None:
                fd = self._copies[rank] = private_files.open_private(wire.metrics_path(self.directory, rank))
            if rank in self._unended:  # a write failed there: the line it tore is ended, and
                _write_all(fd, TORN_END)  # skipped by the reader (a lone mark if none was torn)
                self._unended.discard(rank)
            if rank in self._torn:  # these bytes begin with the rest of a line that was lost
                start = data.find(b"\n")
                if start < 0:
                    return
                data = data[start + 1 :]
                self._torn.discard(rank)
            _write_all(fd, data)
        except OSError as exc:
            # Part of it may be in the copy: never glued to what comes next.
            self._unended.add(rank)
            if ends_a_line:
                self._torn.discard(rank)
            else:
                self._torn.add(rank)
            self._warn("copy", f"metric rows of rank {rank} could not be kept here ({exc})")

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
            self._warn("read", f"reading the ranks' metrics failed: {exc!r}")
            return False

    def close(self) -> int:
        """Stop the thread and write everything the ranks logged; the rows left unstored (0: every
        row is in the store). Never raises; safe to call again (a later retry)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for fd in self._copies.values():  # the ranks are gone: nothing more comes
            os.close(fd)
        self._copies.clear()
        # A store that failed once may answer on a retry (a sqlite store busy for a moment);
        # 3 passes, back to back, give it that chance without holding the call's end for long
        # on a store that is down. A backlog larger than memory takes one pass per MAX_PENDING.
        failures = 0
        while failures < 3:
            if not self._safe_pass():
                failures += 1
            elif not self._pending and not self._unread():
                return 0
        return len(self._pending) + self._unread()

    def _unread(self) -> int:
        """Complete lines in the files that no pass has read yet."""
        count = 0
        for path in self._files():
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets.get(path, 0))
                    while chunk := f.read(1 << 20):
                        count += chunk.count(b"\n")
            except OSError:
                continue
        return count

    def _files(self) -> list[str]:
        names = sorted(os.listdir(self.directory)) if os.path.isdir(self.directory) else []
        # Not the run's name (METRICS_RUN_FILE): only the ranks' .tsv files.
        return [os.path.join(self.directory, name) for name in names if name.endswith(".tsv")]

    def write_pass(self) -> bool:
        """Read new lines and write them; False when the store refused a batch (they stay pending)."""
        with self._lock:
            for path in self._files():
                if len(self._pending) >= MAX_PENDING:
                    break  # the rest waits in the files until these are stored
                for line in self._new_lines(path):
                    if line.endswith(TORN_MARK):  # a copy's line whose rest was lost (said then)
                        continue
                    try:
                        key, value, timestamp, step = line.split("\t")
                        self._pending.append((key, float(value), int(timestamp), int(step)))
                    except ValueError:
                        # A line's start names it in the warning; a garbled line may be long.
                        self._warn("line", f"skipped a line that is not a metric: {line[:80]!r}")
            while self._pending:
                if self._sink is None:
                    self._sink = metric_rows.sink_for(self.client, self.run_id)
                batch = self._pending[: self._sink.batch]
                try:
                    self._sink.write(batch)
                except Exception as exc:  # noqa: BLE001 - kept and retried; training goes on
                    self.last_error = metric_rows.short_error(exc)
                    self._warn(
                        "store",
                        f"MLflow run {self.run_id} refused metric rows ({self.last_error}); the training "
                        "goes on, and the rows wait in the ranks' files to be stored later",
                    )
                    return False
                del self._pending[: len(batch)]
                self.written += len(batch)
            return True

    def _new_lines(self, path: str) -> list[str]:
        """Complete lines added since the last pass (a line being written is left for the next)."""
        try:
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read(READ_BYTES)
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

    def _warn(self, kind: str, message: str) -> None:
        """Once per kind of trouble: a full disk said does not hide a store that refuses later."""
        if kind not in self._warned:
            self._warned.add(kind)
            with contextlib.suppress(Exception):
                warnings.warn(f"air_magic: {message}", RuntimeWarning, stacklevel=2)


TORN_MARK = "\x00"  # ends a line that lost bytes (no metric line holds a NUL)
TORN_END = (TORN_MARK + "\n").encode()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def keep_outcome(directory: str, outcome: str) -> None:
    """The call's outcome beside its rows, for a later process that ends the run (the store refused
    the end); a folder on a full disk too keeps only what it can."""
    with contextlib.suppress(OSError):
        fd = os.open(os.path.join(directory, paths.METRICS_OUTCOME_FILE), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.write(fd, outcome.encode())
        finally:
            os.close(fd)


def import_left_behind(client: Any, run_id: str, folder: str | None = None) -> tuple[int, str | None]:
    """Import the rows a dead caller's metric folders hold for ``run_id``, then remove those folders.

    Returns the rows found, and the call's outcome when a folder kept it (:func:`keep_outcome`).
    Only folders whose owner is dead are read (a live caller's writer is still at work); each is
    read whole: the sqlite sink ignores rows the store already has.
    """
    found, outcome = 0, None
    for path in private_files.dead_callers_folders(paths.METRICS_KIND, folder):
        try:
            with open(os.path.join(path, paths.METRICS_RUN_FILE)) as f:
                if f.read().strip() != run_id:
                    continue
        except OSError:
            continue
        with contextlib.suppress(OSError), open(os.path.join(path, paths.METRICS_OUTCOME_FILE)) as f:
            outcome = f.read().strip() or outcome
        writer = MetricWriter(client, run_id, path)
        left = writer.close()
        found += writer.written
        if not left:
            private_files.remove_tree(path)
    return found, outcome
