"""The last runs of this process: where their logs are and how they ended.

A consumer like the displays; ``air_magic.last_run()`` and ``%distributed
status`` read it in memory. Each call's log folder also gets ``run.json``
(written at the start and again at the end), which ``air-magic runs`` reads
from any process; :func:`read_summaries` lists them.
"""

from __future__ import annotations

import collections
import json
import os
from dataclasses import dataclass, field
from typing import Any

from air_magic import paths, private_files
from air_magic.errors import ConfigurationError
from air_magic.former_names import former_names
from air_magic.protocol import wire
from air_magic.protocol.events import (
    Event,
    Outcome,
    RankExited,
    RankState,
    RecordLink,
    RunFinished,
    RunStarted,
)

KEEP = 50  # calls remembered per process (last_run() needs one; %distributed status shows one)


@former_names(run_id="call_id")
@dataclass
class RunInfo:
    call_id: str  # the call's id (its log folder's name); its MLflow run's is mlflow_run_id
    name: str
    world_size: int
    log_dir: str
    outcome: str = Outcome.RUNNING
    elapsed: float | None = None
    error: str | None = None
    rank_states: dict[int, str] = field(default_factory=dict)
    rank_exit_codes: dict[int, int | None] = field(default_factory=dict)
    values: list[Any] | None = None  # a %%distributed cell's last-expression values, per rank
    tracking: str | None = None  # the MLflow run, in words
    tracking_url: str | None = None
    mlflow_run_id: str | None = None
    failed_rank: int | None = None  # the root cause's rank (the ledger's rule), when it failed

    @property
    def run_id(self) -> str:
        """The former name of :attr:`call_id`."""
        return self.call_id

    def log_path(self, rank: int) -> str:
        return paths.rank_log(self.log_dir, rank)


_runs: collections.deque[RunInfo] = collections.deque(maxlen=KEEP)


class RunHistory:
    """Records each run's start, rank exits and end, and its MLflow run (the ``RecordLink`` event
    before the start)."""

    def __init__(self, *, summary: bool = True) -> None:
        self._current: RunInfo | None = None
        self._record: RecordLink | None = None
        # A persistent session's cell shares the session's log folder: the session writes the summary.
        self._summary = summary

    def handle(self, event: Event) -> None:
        if isinstance(event, RecordLink):
            self._record = event
        elif isinstance(event, RunStarted):
            self._current = RunInfo(event.call_id, event.name, event.world_size, event.log_dir)
            if self._record is not None:
                self._current.tracking = self._record.description
                self._current.tracking_url = self._record.url
                self._current.mlflow_run_id = self._record.run_id
            _runs.append(self._current)
            if self._summary:
                _write_summary(self._current)
        elif self._current is None:
            return
        elif isinstance(event, RankExited):
            self._current.rank_states[event.rank] = event.state.value
            self._current.rank_exit_codes[event.rank] = event.exit_code
        elif isinstance(event, RunFinished):
            self._current.outcome = event.outcome
            self._current.elapsed = event.elapsed
            self._current.error = event.error
            self._current.failed_rank = event.failed_rank
            if event.failed_rank is not None:
                # The root cause's rank failed, whatever ended its process: a session's rank that
                # raised in a cell is stopped with the session (the ledger's "killed").
                self._current.rank_states[event.failed_rank] = RankState.FAILED.value
            if self._summary:
                _write_summary(self._current)


def last_run() -> RunInfo | None:
    """The most recent run of this process (``None`` before the first)."""
    return _runs[-1] if _runs else None


_SUMMARY_FIELDS = (
    "name",
    "world_size",
    "log_dir",
    "outcome",
    "elapsed",
    "error",
    "mlflow_run_id",
    "failed_rank",
)


def _write_summary(info: RunInfo) -> None:
    # "run_id": run.json's key for the call's id, as air-magic runs (and earlier versions) read it.
    summary = {"run_id": info.call_id, **{name: getattr(info, name) for name in _SUMMARY_FIELDS}}
    summary["tracking_url"] = info.tracking_url
    # The process running the call (a kernel, a script, a detached run's supervisor): while it lives
    # and the outcome is "running", the log folder is never pruned (backends/output.py).
    summary["owner"] = private_files.owner_tag()
    summary["rank_states"] = {str(rank): state for rank, state in info.rank_states.items()}
    if summary["error"] and len(summary["error"]) > _ERROR_ROOM:
        summary["error"] = summary["error"][:_ERROR_ROOM] + " [...]"
    data = json.dumps(summary).encode()
    data = data.ljust(SUMMARY_ROOM)  # JSON allows the trailing spaces
    path = paths.run_summary(info.log_dir)
    try:
        wire.write_atomically(path, data)
    except OSError:  # a full disk (the ranks' logs filled it): over the first version, in its room
        _overwrite(path, data)


SUMMARY_ROOM = 4096  # run.json's size: on a disk that filled up during the call, the end fits here
_ERROR_ROOM = 1500


def _overwrite(path: str, data: bytes) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    except OSError:  # a log folder that went away must not fail the call
        return
    try:
        room = os.fstat(fd).st_size
        if len(data) <= room:
            os.pwrite(fd, data.ljust(room), 0)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_summaries(log_root: str) -> list[dict[str, Any]]:
    """Every call's summary under ``log_root``, newest first (a folder without one: outcome unknown)."""
    found = []
    try:
        folders = sorted(os.scandir(log_root), key=lambda e: e.name, reverse=True)
    except FileNotFoundError:
        return []
    except OSError as exc:  # unreadable, or not a folder: one line for the user, not a traceback
        raise ConfigurationError(f"cannot read the runs' folder {log_root}: {exc.strerror or exc}") from None
    for entry in folders:
        if not entry.is_dir():
            continue
        try:
            with open(paths.run_summary(entry.path)) as f:
                summary = json.load(f)
        except (OSError, ValueError):
            summary = {"run_id": entry.name, "name": "?", "outcome": Outcome.UNKNOWN, "log_dir": entry.path}
        if isinstance(summary, dict) and private_files.call_still_running(summary) is False:
            # Its process was killed mid-call (SIGKILL, a kernel restart): it never wrote an end.
            summary["outcome"] = "lost"
            summary["error"] = "the process that made this call ended before the call did (killed?)"
        found.append(summary)
    return found
