"""Rank processes on one machine: how one is started, the handle on it, and where its output is read.

Used by the local backend's loop and by the Ray backend's node agents alike.
:func:`spawn_rank` starts a rank: a fork of the warm starter, or a fresh
interpreter. Both kinds of handle answer the same questions (``pid``,
``poll()``, ``wait()``, ``returncode``), which is all that watching and
stopping need (``process_tree.RankProcess``). :class:`RankSlot` adds what a
loop tracks per rank: its pidfd, its state, when it was last seen alive.
:class:`RankPipes` reads every rank's stdout and stderr.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import psutil

from air_magic.node import warm
from air_magic.protocol import env_names, wire
from air_magic.protocol.events import RankState
from air_magic.worker import entry

# A rank's stdout and stderr pipes hold this much (Linux's default is 64 KiB; 1 MiB is what an
# unprivileged process may ask for, /proc/sys/fs/pipe-max-size): a rank printing in a burst goes
# on writing while the caller is busy, instead of blocking every 64 KiB.
_PIPE_SIZE = 1 << 20
_READ_SIZE = _PIPE_SIZE  # one read empties a full pipe
# A dead rank's pipe holds at most one capacity; reads beyond that are a grandchild
# still writing, which must not keep the exit from being reported.
_DRAIN_READS = 4


def spawn_rank(
    starter: warm.Starter | None,
    rank: int,
    env: dict[str, str],
    cwd: str,
    call_dir: str,
    lifeline_r: int,
    out_w: int,
    err_w: int,
    out_r: int,
    err_r: int,
) -> FreshRank | ForkedRank:
    """Start one rank: forked by the warm starter when there is one, else a fresh ``sys.executable``.

    The rank gets the read ends of its own pipes too (``out_r``, ``err_r``): it never reads them
    while the caller lives; if the caller dies, what they still hold goes into the rank's log."""
    if starter is not None:
        try:
            pid = starter.spawn(env, cwd, call_dir, [out_w, err_w, lifeline_r, out_r, err_r])
            return ForkedRank(pid, starter, call_dir, rank)
        except OSError:
            pass  # the starter broke: this rank starts fresh, and the next call gets a new starter
    proc = subprocess.Popen(
        [sys.executable, "-c", entry.BOOTSTRAP, call_dir],
        cwd=cwd,
        env={**env, env_names.OUTPUT_FDS: f"{out_r},{err_r}"},
        stdin=subprocess.DEVNULL,
        stdout=out_w,
        stderr=err_w,
        pass_fds=(lifeline_r, out_r, err_r),
        start_new_session=True,  # its own process group: teardown reaches its children
    )
    return FreshRank(proc)


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

    def __init__(self, pid: int, starter: warm.Starter, call_dir: str, rank: int):
        self.pid = pid
        self.starter = starter
        self.call_dir = call_dir
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
        if os.path.exists(wire.result_path(self.call_dir, self.rank)):
            return 0
        if os.path.exists(wire.error_path(self.call_dir, self.rank)):
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
        self.pipe_fds: tuple[int, ...] = ()  # its stdout and stderr pipes (RankPipes.start)

    @property
    def status_lost(self) -> bool:
        """Its exit status is unknown: the warm starter died before reporting it."""
        return isinstance(self.proc, ForkedRank) and self.proc.status_lost


def send_signal(slot: RankSlot, signum: int) -> None:
    """``signum`` to the rank's process only, through its pidfd when it has one (never a reused pid)."""
    try:
        if slot.pidfd is not None:
            signal.pidfd_send_signal(slot.pidfd, signum)
        else:
            os.kill(slot.proc.pid, signum)
    except (ProcessLookupError, OSError):
        pass  # it has ended


class RankPipes:
    """Where rank output is read: every rank's stdout and stderr pipes, in the loop's selector.

    Bytes go to ``sink(rank, stream, data)`` in the order the rank wrote them.
    A loop empties a rank's pipes (:meth:`drain_rank`) before it reports that
    rank's exit, so whoever sees the exit has seen all the rank's own output
    (a display flushes an unfinished line at the exit: read late, one line
    would be cut in two).
    """

    def __init__(self, selector: selectors.BaseSelector, sink: Callable[[int, str, bytes], None]):
        self.selector = selector
        self._sink = sink

    def start(self, rank: int, spawn: Callable[[int, int, int, int], FreshRank | ForkedRank]) -> RankSlot:
        """Make the rank's pipes, ``spawn(out_w, err_w, out_r, err_r)`` it, and watch its pipes and pidfd."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        for fd in (out_r, err_r):
            with contextlib.suppress(OSError):  # refused past the user's pipe quota: the default size
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)
        try:
            proc = spawn(out_w, err_w, out_r, err_r)
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)  # the rank holds the write ends now: EOF once it and its children are gone
            os.close(err_w)
        slot = RankSlot(rank, proc)
        slot.pipe_fds = (out_r, err_r)
        for stream, fd in (("stdout", out_r), ("stderr", err_r)):
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ, (slot, stream))
        if slot.pidfd is not None:
            self.selector.register(slot.pidfd, selectors.EVENT_READ, (slot, None))
        return slot

    def read(self, fd: int, slot: RankSlot, stream: str) -> bool:
        """One read of a readable pipe; True when it gave bytes (there may be more)."""
        try:
            data = os.read(fd, _READ_SIZE)
        except BlockingIOError:
            return False
        if not data:  # EOF: the rank and everything it started closed this pipe
            self.selector.unregister(fd)
            os.close(fd)
            return False
        self._sink(slot.rank, stream, data)
        return True

    def drain_rank(self, slot: RankSlot) -> None:
        """Everything already in this rank's pipes, without waiting for more."""
        watched = self.selector.get_map()
        for fd in slot.pipe_fds:  # its own pipes only: a look at all of them per rank is slow at 1,000
            key = watched.get(fd)
            if key is None or key.data[0] is not slot:  # closed at its EOF (the number may be reused)
                continue
            for _ in range(_DRAIN_READS):
                if not self.read(fd, slot, key.data[1]):
                    break

    def pump(self) -> None:
        """What the ranks have written meanwhile, without waiting (during a stop's grace: their
        output still shows, and a full pipe never blocks a rank that is saving a checkpoint)."""
        for key, _ in self.selector.select(0):
            slot, stream = key.data
            if isinstance(slot, RankSlot) and stream is not None:
                for _ in range(_DRAIN_READS):
                    if not self.read(key.fd, slot, stream):
                        break

    def drain(self, limit_s: float) -> None:
        """At the end of a call: read the pipes until EOF or ``limit_s`` (a grandchild may hold one
        open), then close them and stop watching everything else (pidfds, the starter's socket)."""
        for key in list(self.selector.get_map().values()):
            if key.data[1] is None:
                self.selector.unregister(key.fileobj)
        end = time.monotonic() + limit_s
        while self.selector.get_map() and time.monotonic() < end:
            for key, _ in self.selector.select(max(0.0, end - time.monotonic())):
                slot, stream = key.data
                while self.read(key.fd, slot, stream) and time.monotonic() < end:
                    pass
        for key in list(self.selector.get_map().values()):
            self.selector.unregister(key.fileobj)
            os.close(key.fd)
