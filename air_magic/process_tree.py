"""Stopping processes for good: ask, a grace, then SIGKILL of whole process trees. The one place.

Every process air_magic starts (ranks, the warm starter, the MLflow UI's keeper
and server) leads its own process group (``start_new_session``), so a signal
to the group reaches it and everything it forked (DataLoader workers,
compilers). Descendants that left the group (``setsid``) are found with
psutil *before* signalling, while they are still linked to their parent. The
final SIGKILL to every group is sent even after a clean exit, so nothing a
process left behind outlives it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import psutil


class RankProcess(Protocol):
    """What stopping needs of a rank: a fresh child (Popen) or a rank forked by the warm starter."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def stop_trees(
    procs: Sequence[RankProcess],
    grace_s: float,
    known: Iterable[psutil.Process] = (),
    *,
    ask: signal.Signals | None = signal.SIGTERM,
    meanwhile: Callable[[], None] | None = None,
) -> None:
    """Stop every process in ``procs`` and all of its descendants; reap ``procs``.

    First they are asked to stop: ``ask`` is sent to every group and descendant
    (``None``: the caller has already asked another way, closing a pipe say). After
    ``grace_s`` (0: at once) whatever is left gets SIGKILL. ``known`` are descendants
    seen earlier (see :class:`DescendantTracker`), which may have lost their link
    to a process that died since. ``meanwhile`` is called every tick of the grace (the
    ranks' output is read on: a long grace must not leave them blocked on a full pipe).
    """
    pgids = [p.pid for p in procs]
    by_pid = {p.pid: p for p in known}
    by_pid.update((p.pid, p) for p in descendants(p.pid for p in procs if p.poll() is None))
    others = [p for p in by_pid.values() if _alive(p)]
    if grace_s > 0:
        if ask is not None:
            _signal(pgids, others, ask)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if all(p.poll() is not None for p in procs) and not any(_alive(o) for o in others):
                break
            if meanwhile is not None:
                meanwhile()
            time.sleep(0.02)
    _signal(pgids, others, signal.SIGKILL)
    for p in procs:
        p.wait()
    psutil.wait_procs([o for o in others if _alive(o)], timeout=2.0)


class DescendantTracker:
    """Remembers every descendant of the ranks seen so far, checked at most every ``interval_s``.

    A rank killed by a signal cannot clean up after itself, and its children
    that left its process group are re-parented away from it. Seen earlier,
    they can still be stopped.
    """

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self.seen: dict[int, psutil.Process] = {}
        self._next = 0.0

    def update(self, pids: Iterable[int]) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval_s
        for proc in descendants(pids):
            self.seen.setdefault(proc.pid, proc)


def descendants(pids: Iterable[int]) -> list[psutil.Process]:
    """Every descendant of ``pids``, from one look at the process table (psutil's ``children()``
    reads all of it for each process asked about: 2.1 s of a stop of 256 ranks, profiled)."""
    roots = [pid for pid in pids if _ours_to_signal(pid)]
    if not roots:
        return []
    # psutil >= 6 keeps process_iter's Process objects for the life of this process and no longer
    # checks them for a reused pid on the way: one of a process long gone would hide (or stand for)
    # the new holder of its pid. Fresh objects every look, as children() made.
    clear = getattr(psutil.process_iter, "cache_clear", None)
    if clear is not None:
        clear()
    children: dict[int, list[psutil.Process]] = {}
    for proc in psutil.process_iter(["ppid"]):
        parent = proc.info["ppid"]
        if parent:  # None: a zombie or a process we may not read
            children.setdefault(parent, []).append(proc)
    found: list[psutil.Process] = []
    seen = set(roots)
    waiting = list(roots)
    while waiting:
        for child in children.get(waiting.pop(), ()):
            if child.pid not in seen:
                seen.add(child.pid)
                found.append(child)
                waiting.append(child.pid)
    return found


def _ours_to_signal(pid: int) -> bool:
    """Never init (1), "every process" (0, -1), nor this process or its own group: a last guard."""
    return pid > 1 and pid != os.getpid() and pid != os.getpgrp()


def _signal(pgids: Iterable[int], others: Iterable[psutil.Process], sig: int) -> None:
    for pgid in pgids:
        if not _ours_to_signal(pgid):
            continue
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in others:
        if not _ours_to_signal(proc.pid):
            continue
        try:
            proc.send_signal(sig)
        except psutil.Error:
            pass


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
