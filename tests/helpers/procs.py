"""Processes in tests: waiting for pids to end, and what a test left behind.

The test process is a child subreaper (conftest), so anything a rank leaves behind is
re-parented to it and shows up among its descendants.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import psutil

LEFTOVER_WAIT_S = 5.0


def alive_after(pids: Iterable[int], seconds: float = 5.0) -> list[int]:
    """The ``pids`` still alive (zombies count as gone) once ``seconds`` have passed, or [] sooner."""
    pids = list(pids)
    deadline = time.monotonic() + seconds
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def gone_within(pids: Iterable[int], seconds: float = 5.0) -> bool:
    """True once none of ``pids`` is a live process (zombies count as gone), within ``seconds``."""
    return not alive_after(pids, seconds)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def reap_zombies() -> None:
    for child in psutil.Process().children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(child.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError):
            pass


def leftover_processes(timeout: float = LEFTOVER_WAIT_S) -> list[psutil.Process]:
    """Descendants still alive after ``timeout`` seconds (zombies are reaped as we go).

    The warm starter of this process is meant to stay (it is a cache); what it started is not.
    """
    from air_magic.node import warm

    deadline = time.monotonic() + timeout
    while True:
        reap_zombies()
        alive = []
        keep = warm.starter_pid()
        for proc in psutil.Process().children(recursive=True):
            if proc.pid == keep or rays_own(proc):
                continue
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.Error:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


# The tests' Ray cluster (conftest's ray_cluster) is pytest's child and stays from its first test to
# its last: its processes, and the warm starters of its node agents, are not leftovers. Ranks are.
_RAY_MARKS = (
    "raylet",
    "gcs_server",
    "ray::",
    "ray/_private",
    "ray/dashboard",
    "ray/autoscaler",
    "default_worker.py",
    "bin/ray start",  # a test's Ray head (tests/ray_cluster/test_ray_jobs.py), stopped by its module
    "ray.util.client.server",  # the Ray Client server of such a head
)


def rays_own(proc: psutil.Process) -> bool:
    """Whether ``proc`` belongs to the tests' Ray cluster (gone meanwhile counts as its own)."""
    try:
        line = " ".join(proc.cmdline())
        if proc.name().startswith("ray::") or any(mark in line for mark in _RAY_MARKS):
            return True
        if "multiprocessing.resource_tracker" in line:  # of Ray's dashboard, say
            parent = proc.parent()
            return parent is not None and rays_own(parent)
        if "starter_main" in line:  # a node agent's warm starter; a rank forked from it is not Ray's
            parent = proc.parent()
            return (
                parent is not None and rays_own(parent) and "starter_main" not in " ".join(parent.cmdline())
            )
    except psutil.Error:
        return True  # gone meanwhile
    return False
