"""The wire format between the launcher and a rank: files in the run directory.

Nothing travels over a socket of ours. The launcher writes ``launch.json``
(the caller's ``sys.path`` and ``sys.argv``) and ``payload.pkl`` (cloudpickle
of ``(fn, args, kwargs, cell_sources)``) into a private (0700) run directory; each rank writes
``result-<rank>.pkl`` on success or ``error-<rank>.pkl`` on failure, each
atomically (write, then rename), and the launcher reads them after the rank
exits. The worker side imports only this module, ``serialization`` and the
standard library.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

LAUNCH_FILE = "launch.json"
PAYLOAD_FILE = "payload.pkl"


def metrics_path(metrics_dir: str, rank: int | str) -> str:
    return os.path.join(metrics_dir, f"rank-{rank}.tsv")


def result_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"result-{rank}.pkl")


def error_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"error-{rank}.pkl")


def loaded_path(run_dir: str, rank: int) -> str:
    """An empty mark: this rank has read the payload (the launcher then deletes it)."""
    return os.path.join(run_dir, f"loaded-{rank}")


@dataclass
class ErrorRecord:
    """What a rank reports when it fails.

    ``time`` is ``time.monotonic()`` in the rank: CLOCK_MONOTONIC is one clock
    for the whole machine on Linux, so the launcher can order failures of
    different ranks and name the earliest as the root cause.
    """

    rank: int
    time: float
    stage: str  # 'load' (payload), 'run' (the function), 'result' (pickling the return value)
    type_name: str
    message: str
    traceback: str
    exception: bytes | None  # the pickled exception, when it could be pickled


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
