"""Every thread's Python stack of running ranks, taken from the caller: py-spy, else a signal.

:func:`take_stacks` answers ``%distributed stack``, ``handle.stacks()`` and a
timeout (whose error shows the stacks before the ranks are stopped). Two ways:

- **py-spy** (``pip install 'air_magic[debug]'``): reads the rank's memory from
  outside; shows thread names and which threads are idle, and needs nothing of
  the rank. It needs permission to trace the process (ptrace), which some
  containers deny; then the signal is used for that rank.
- **a signal** (protocol/stacks.py): the rank's faulthandler writes its threads'
  stacks to a file in the call's log folder; the new bytes are read back.

``AIR_MAGIC_STACKS`` = ``auto`` (default), ``py-spy`` or ``signal`` picks one.
Every dump is also appended to ``stacks.txt`` in the call's log folder, which
the MLflow run keeps with the logs.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping

import psutil

from air_magic import paths
from air_magic.protocol import env_names
from air_magic.protocol.stacks import RANK_FILE_PREFIX, STACKS_SIGNAL, stacks_path

PY_SPY_TIMEOUT_S = 10.0  # one dump usually takes 0.1-0.5 s; a rank in uninterruptible sleep may not answer
SIGNAL_WAIT_S = 3.0  # how long a rank may take to write its dump after the signal
_QUIET_S = 0.15  # the dump is complete when the file has stopped growing this long
STACKS_FILE = paths.STACKS_FILE
# A frame in air_magic's own code, as faulthandler ('File "/x/air_magic/worker/entry.py"') and
# py-spy ('main (air_magic/worker/entry.py:83)') write it.
_THREADING = re.compile(r"[/(\s]threading\.py")  # a thread's own start-up frames
_OUR_FRAME = re.compile(r"(^|[\s(\"/])air_magic/(worker|backends|protocol|launch|session|data)/[\w/]+\.py")
TIMEOUT_FRAMES = 6  # frames per thread in a timeout's message (stacks.txt has them all)


def py_spy_path() -> str | None:
    """The py-spy program beside this Python (a venv's bin), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("py-spy")


def method() -> str:
    """'py-spy' or 'signal': what :func:`take_stacks` tries first."""
    wanted = os.environ.get(env_names.STACKS, "auto").strip().lower() or "auto"
    if wanted == "signal":
        return "signal"
    return "py-spy" if py_spy_path() is not None else "signal"


def take_stacks(pids: Mapping[int, int], log_dir: str, why: str = "on request") -> dict[int, str]:
    """Each rank's stacks, by rank, for ``pids`` (rank -> pid) of one call; also kept in its log folder.

    A rank that cannot be read gets a line saying why instead of a stack. Never raises
    for a rank that ended meanwhile.
    """
    if not pids:
        return {}
    use_py_spy = method() == "py-spy"
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(pids))) as pool:
        futures = {rank: pool.submit(_one_rank, rank, pid, log_dir, use_py_spy) for rank, pid in pids.items()}
        stacks = {rank: future.result() for rank, future in sorted(futures.items())}
    _keep(stacks, pids, log_dir, why)
    return stacks


def format_stacks(stacks: Mapping[int, str], max_frames: int | None = None, ours: bool = False) -> str:
    """One text for every rank, each thread's innermost frame first.

    ``max_frames`` keeps that many frames per thread; ``ours=False`` leaves out
    air_magic's own frames and threads (the lifeline watcher, the rank's entry),
    and py-spy's process header: what is left is the user's code.
    """
    parts = []
    for rank, text in sorted(stacks.items()):
        lines: list[str] = []
        for head, frames in _threads(text):
            if not ours:
                own = [f for f in frames if not _OUR_FRAME.search(f) and not _THREADING.search(f)]
                if not own:  # every frame air_magic's or threading's: a thread of ours (the lifeline)
                    continue
                frames = [f for f in frames if not _OUR_FRAME.search(f)]
            if max_frames is not None and len(frames) > max_frames:
                frames = [*frames[:max_frames], f"  ... {len(frames) - max_frames} outer frames not shown"]
            lines += [head, *frames]
        body = "\n".join(f"    {line}" for line in lines) if lines else "    (no frames of its own code)"
        parts.append(f"  rank {rank}:\n{body}")
    return "\n".join(parts)


def _threads(text: str) -> list[tuple[str, list[str]]]:
    """(header, frames) per thread of one dump, faulthandler's or py-spy's; other lines as headers."""
    threads: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line[0].isspace() and threads:
            threads[-1][1].append(line)
        elif line.startswith(("Process ", "Python v")):  # py-spy's header: the command line, the version
            continue
        else:
            threads.append((line, []))
    return threads


def timeout_section(stacks: Mapping[int, str], log_dir: str) -> list[str]:
    """The lines a timeout's error adds: what each rank was doing when the time ran out."""
    if not stacks:
        return []
    where = os.path.join(log_dir, STACKS_FILE)
    shown = format_stacks(stacks, max_frames=TIMEOUT_FRAMES)
    return [f"  What each rank was doing (innermost frame first; all of it in {where}):\n{shown}"]


def _one_rank(rank: int, pid: int, log_dir: str, use_py_spy: bool) -> str:
    path = stacks_path(log_dir, rank)
    if os.path.exists(path) and not _is_rank_of(pid, path):  # the rank is gone; the pid may be reused
        return "(no stacks: the rank had already ended)"
    if use_py_spy:
        text = _py_spy_dump(pid)
        if text is not None:
            return text
    return _signal_dump(rank, pid, log_dir)


def _py_spy_dump(pid: int) -> str | None:
    """py-spy's dump of one process, or None when py-spy could not read it (gone, or not permitted)."""
    program = py_spy_path()
    if program is None:
        return None
    try:
        done = subprocess.run(
            [program, "dump", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=PY_SPY_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0 or not done.stdout.strip():
        return None
    return done.stdout


def _signal_dump(rank: int, pid: int, log_dir: str) -> str:
    path = stacks_path(log_dir, rank)
    try:
        before = os.path.getsize(path)
    except OSError:
        return "(no stacks: the rank had not started its Python code yet, or cannot write its log folder)"
    if not _is_rank_of(pid, path):
        return "(no stacks: the rank had already ended)"
    try:
        os.kill(pid, STACKS_SIGNAL)
    except ProcessLookupError:
        return "(no stacks: the rank had already ended)"
    except PermissionError:
        return "(no stacks: not permitted to signal the rank)"
    end = time.monotonic() + SIGNAL_WAIT_S
    size, changed = before, time.monotonic()
    while time.monotonic() < end:
        time.sleep(0.02)
        try:
            now_size = os.path.getsize(path)
        except OSError:
            break
        if now_size != size:
            size, changed = now_size, time.monotonic()
        elif size > before and time.monotonic() - changed >= _QUIET_S:
            break
    if size <= before:
        return f"(no stacks: the rank did not answer within {SIGNAL_WAIT_S:g} s)"
    with open(path, "rb") as f:
        f.seek(before)
        return f.read(size - before).decode("utf-8", "replace")


def _is_rank_of(pid: int, path: str) -> bool:
    """The process still holds this rank's stacks file open: it is the rank (its pid was not
    reused by another process, which the signal's default action would end)."""
    try:
        return any(f.path == path for f in psutil.Process(pid).open_files())
    except psutil.Error:  # gone, or not ours to look at: do not signal
        return False


def discard_rank_files(log_dir: str) -> None:
    """At the end of a call: the ranks' own stack files go (every dump taken is in stacks.txt)."""
    try:
        names = [n for n in os.listdir(log_dir) if n.startswith(RANK_FILE_PREFIX)]
    except OSError:
        return
    for name in names:
        try:
            os.unlink(os.path.join(log_dir, name))
        except OSError:
            pass


def _keep(stacks: Mapping[int, str], pids: Mapping[int, int], log_dir: str, why: str) -> None:
    """Append this dump to the call's stacks.txt (best effort: the stacks are returned anyway)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    text = "".join(
        f"=== {stamp} rank {rank} (pid {pids[rank]}), {why} ===\n{body.rstrip()}\n\n"
        for rank, body in sorted(stacks.items())
    )
    try:
        fd = os.open(
            os.path.join(log_dir, STACKS_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600
        )
        with os.fdopen(fd, "a") as f:
            f.write(text)
    except OSError:
        pass
