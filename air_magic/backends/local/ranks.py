"""Handles on the local backend's rank processes: fresh children or forks of the warm starter.

Both kinds answer the same questions (``pid``, ``poll()``, ``wait()``,
``returncode``), which is all that watching and stopping need
(``process_tree.RankProcess``). :class:`RankSlot` adds what the call's loop
tracks per rank: its pidfd, its state, when it was last seen alive.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil

from air_magic.backends.local import warm
from air_magic.protocol import wire
from air_magic.protocol.events import RankState


class FreshRank:
    """A rank started as a fresh ``sys.executable`` (our child: Popen knows its exit code)."""

    def __init__(self, proc: subprocess.Popen[bytes]):
        self.proc = proc
        self.pid = proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)


class ForkedRank:
    """A rank forked by the warm starter: not our child, so the starter reports its exit code."""

    def __init__(self, pid: int, starter: warm.Starter, run_dir: str, rank: int):
        self.pid = pid
        self.starter = starter
        self.run_dir = run_dir
        self.rank = rank
        self.returncode: int | None = None
        self.status_lost = False  # the starter died before it could report this rank's exit

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.starter.poll(self.pid)
            if self.returncode is None and not self.starter.alive() and not _running(self.pid):
                self.returncode = self._status_from_files()
        return self.returncode

    def _status_from_files(self) -> int:
        """The starter died, so the exit status is lost; what the rank wrote still tells how it ended.

        A rank writes its result (or its error) before exiting 0 (or 1): a result
        that was written counts, whatever happened to the starter afterwards.
        """
        self.status_lost = True
        if os.path.exists(wire.result_path(self.run_dir, self.rank)):
            return 0
        if os.path.exists(wire.error_path(self.run_dir, self.rank)):
            return 1
        return -signal.SIGKILL

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode


def _running(pid: int) -> bool:
    """The process is running (a zombie has ended: only its exit status waits to be collected)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


class RankSlot:
    """One rank of the call, as the loop follows it."""

    def __init__(self, rank: int, proc: FreshRank | ForkedRank):
        self.rank = rank
        self.proc = proc
        self.warm_started = isinstance(proc, ForkedRank)
        self.pidfd: int | None = None
        try:
            self.pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # old kernel: the loop polls instead
            self.pidfd = None
        self.exit_code: int | None = None
        self.exited_at: float | None = None  # the loop's last time it saw the rank alive
        self.dead_since: float | None = None  # seen gone (pidfd) before its exit code came
        self.state = RankState.STARTING

    @property
    def status_lost(self) -> bool:
        """Its exit status is unknown: the warm starter died before reporting it."""
        return isinstance(self.proc, ForkedRank) and self.proc.status_lost
