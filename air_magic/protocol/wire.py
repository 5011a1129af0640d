"""The wire format between a backend and a rank: what travels, and the local transport (files).

Nothing travels over a socket of ours. The local backend writes ``launch.json``
(the caller's ``sys.path`` and ``sys.argv``) and ``payload.pkl`` (cloudpickle of
``(fn, args, kwargs, cell_sources)``) into a private (0700) call folder; each rank
writes ``result-<rank>.pkl`` on success or ``error-<rank>.pkl`` on failure, each
atomically (write, then rename), and the backend reads them after the rank exits.
A rank reaches them through :class:`CallFolder`, one implementation of
:class:`RankTransport`; a remote agent can hand a rank another. The worker side
imports only this module, ``serialization`` and the standard library.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Protocol

from air_magic.protocol import serialization

LAUNCH_FILE = "launch.json"
PAYLOAD_FILE = "payload.pkl"


def rank_log_path(log_dir: str, rank: int | str) -> str:
    """A rank's log in the call's log folder: stdout and stderr, whole lines (the caller writes
    it from the rank's pipes; a rank whose caller died appends what the pipes still held)."""
    return os.path.join(log_dir, f"rank-{rank}.log")


def metrics_path(metrics_dir: str, rank: int | str) -> str:
    return os.path.join(metrics_dir, f"rank-{rank}.tsv")


# MLFLOW_TRACKING_URI for the ranks of an untracked call (tracking/remote.py): a rank replaces it
# with a sqlite file of its own in its call folder (worker/entry.py), removed with the folder. Not
# the store that failed (MLflow's retries would hold a rank's first log_metric for minutes), not
# one file for all ranks (they race to make its tables), not ":memory:" itself (one database per
# thread: a callback's or MLflow's async logging thread would find no tables).
UNTRACKED_MLFLOW_URI = "sqlite:///:memory:"


def untracked_mlflow_uri(call_dir: str, rank: int | str) -> str:
    return "sqlite:///" + os.path.join(call_dir, f"untracked-mlflow-{rank}.db")


# What a rank prints when its error record cannot be written (a full temp folder): the caller's
# death message (outcome/failures.py) then says so first, and the traceback is in the lines shown.
ERROR_RECORD_UNWRITTEN = "[air_magic] this rank's error record could not be written"


def metric_line(key: str, value: float, timestamp_ms: int, step: int) -> str:
    """One metric as a rank appends it to its metric file (the caller's writer reads it back)."""
    return f"{key}\t{float(value)!r}\t{timestamp_ms}\t{step}\n"


def result_path(call_dir: str, rank: int) -> str:
    return os.path.join(call_dir, f"result-{rank}.pkl")


def error_path(call_dir: str, rank: int) -> str:
    return os.path.join(call_dir, f"error-{rank}.pkl")


def session_cell_path(call_dir: str, cell: int) -> str:
    """A persistent session's cell N: its payload, read by every rank (calls/persistent.py)."""
    return os.path.join(call_dir, f"cell-{cell}.pkl")


def cell_result_path(call_dir: str, cell: int, rank: int) -> str:
    return os.path.join(call_dir, f"cell-{cell}-result-{rank}.pkl")


def cell_error_path(call_dir: str, cell: int, rank: int) -> str:
    return os.path.join(call_dir, f"cell-{cell}-error-{rank}.pkl")


def session_fifo(call_dir: str, direction: str, rank: int) -> str:
    """A session rank's named pipe: 'cmd' (caller -> rank: which cell to run) or 'reply' (rank ->
    caller: the cell is done). Each message is one JSON line shorter than PIPE_BUF, so a write is
    atomic; payloads and results travel as files beside them, like a call's."""
    return os.path.join(call_dir, f"{direction}-{rank}.fifo")


def loaded_path(call_dir: str, rank: int) -> str:
    """An empty mark: this rank has read the payload (its rank group then deletes it)."""
    return os.path.join(call_dir, f"loaded-{rank}")


@dataclass
class ErrorRecord:
    """What a rank reports when it fails.

    ``time`` is ``time.monotonic()`` in the rank: CLOCK_MONOTONIC is one clock
    for the whole machine on Linux, so the caller can order failures of
    different ranks and name the earliest as the root cause.
    """

    rank: int
    time: float
    stage: str  # 'load' (payload), 'run' (the function), 'result' (pickling the return value)
    type_name: str
    message: str
    traceback: str
    exception: bytes | None  # the pickled exception, when it could be pickled

    @classmethod
    def of(cls, exc: BaseException, rank: int, when: float, stage: str, text: str) -> ErrorRecord:
        """The record for ``exc`` (``text``: its traceback as the rank prints it), with the exception
        pickled when it can travel: one that does not load again (an unusual ``__init__``) comes back
        as its text only. A ``str()`` that raises does not lose the record."""
        pickled: bytes | None
        try:
            pickled = serialization.dumps(exc)
            serialization.loads(pickled)
        except Exception:  # noqa: BLE001 - a user's exception: anything may fail
            pickled = None
        try:
            message = str(exc)
        except Exception:  # noqa: BLE001 - str() of a user's exception can raise anything
            message = f"<{type(exc).__name__}: str() failed>"
        type_name = f"{type(exc).__module__}.{type(exc).__qualname__}"
        return cls(rank, when, stage, type_name, message, text, pickled)


def write_atomically(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
        finally:
            os.close(fd)
    except BaseException:
        try:  # a half-written file (a full disk) is never taken for a result
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.replace(tmp, path)


def read_bytes(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def wait_for_eof(fd: int) -> None:
    """Block until the other end of the pipe ``fd`` is closed: a lifeline's only message."""
    while True:
        try:
            if not os.read(fd, 1):
                return
        except InterruptedError:
            continue
        except OSError:
            return


class RankTransport(Protocol):
    """How a rank receives its part of a call and hands back its outcome (worker/entry.py uses it)."""

    rank: int

    def read_launch(self) -> dict[str, Any]: ...  # the caller's sys.path and argv

    def read_payload(self) -> bytes: ...

    def mark_loaded(self) -> None: ...  # the payload may be deleted now (the arguments, in clear)

    def write_result(self, data: bytes) -> None: ...

    def write_error(self, data: bytes) -> None: ...  # a pickled ErrorRecord


class CallFolder:
    """The local transport: files in the call's private folder, each written atomically."""

    def __init__(self, call_dir: str, rank: int):
        self.call_dir = call_dir
        self.rank = rank

    def read_launch(self) -> dict[str, Any]:
        with open(os.path.join(self.call_dir, LAUNCH_FILE)) as f:
            launch: dict[str, Any] = json.load(f)
        return launch

    def read_payload(self) -> bytes:
        self._check_private()
        with open(os.path.join(self.call_dir, PAYLOAD_FILE), "rb") as f:
            return f.read()

    def mark_loaded(self) -> None:
        write_atomically(loaded_path(self.call_dir, self.rank), b"")

    def write_result(self, data: bytes) -> None:
        write_atomically(result_path(self.call_dir, self.rank), data)

    def write_error(self, data: bytes) -> None:
        write_atomically(error_path(self.call_dir, self.rank), data)

    def _check_private(self) -> None:
        """Unpickle only from a folder no one else can write: ours, and closed to others (0700)."""
        info = os.stat(self.call_dir)
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise PermissionError(
                f"refusing to load the payload: {self.call_dir} is not a private folder of this user "
                f"(owner uid {info.st_uid}, mode {oct(info.st_mode & 0o777)})"
            )
