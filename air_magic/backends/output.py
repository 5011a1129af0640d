"""Where rank output goes: per-rank log files, live events, and a tail for error messages.

Each rank's stdout and stderr are pipes (file-descriptor level, so C
``printf`` and NCCL's messages are caught too). The rank groups read
them and hands each chunk to :class:`OutputRouter`, which

1. appends the raw bytes to ``<log_dir>/rank-<N>.log``, so the full log
   survives whatever the display does. Both streams share the file, whole
   lines at a time (a partial line waits for its newline), so a stdout line
   and a stderr line never end up glued together; their relative order is
   the order the rank group read them, which two pipes cannot make exact;
2. emits a :class:`~air_magic.protocol.events.RankOutput` event with the decoded text;
3. keeps the last lines of each rank for timeout and failure messages.

A log that cannot be written (a full disk, a quota, a file-size limit) stops
being written: one line in the rank's output says so, and the ranks, the live
display and the call's outcome go on (docs/reliability.md).

Log directories default to ``$XDG_STATE_HOME/air_magic/runs`` (usually
``~/.local/state/air_magic/runs``), one private folder per run; the newest
:data:`KEEP_RUNS` are kept there. A log root that is not this user's alone is
refused before anything starts, and log files never follow a link
(``private_files``, docs/security.md).
"""

from __future__ import annotations

import codecs
import collections
import json
import os
import shutil

from air_magic import paths, private_files
from air_magic.errors import ConfigurationError
from air_magic.protocol.events import EventBus, RankOutput
from air_magic.protocol.lines import MAX_PARTIAL, LineSplitter, visible

KEEP_RUNS = 100  # log folders kept under the default root: weeks of work, megabytes not gigabytes
TAIL_LINES = 20  # last lines kept per rank for error messages (which show 5 to 10)


_LOG_ROOT_FIX = "Pass log_dir= (or set AIR_MAGIC_LOG_DIR) to a folder only you can write"


def make_log_dir(root: str | None, call_id: str) -> str:
    """Create the run's private log folder (0700); prune old runs under the default root."""
    base = root or paths.default_log_root()
    path = os.path.join(base, call_id)
    try:
        os.makedirs(base, mode=0o700, exist_ok=True)
        # Ours alone, or refused: another user who can write it could plant links we would follow.
        private_files.private_root(base, "the log folder", _LOG_ROOT_FIX)
        os.mkdir(path, mode=0o700)
    except OSError as exc:
        raise ConfigurationError(
            f"cannot create the run's log folder {path}: {exc.strerror}. Pass log_dir= (or set "
            "AIR_MAGIC_LOG_DIR) to a folder you can write to; nothing was launched."
        ) from exc
    if root is None:
        _prune(base)
    # Without links or a relative part: the folder's name stays right after a chdir, and equals what
    # the kernel reports for files opened in it (stacks: outcome/stacks.py compares them).
    return os.path.realpath(path)


def _prune(base: str) -> None:
    try:
        runs = [e for e in os.scandir(base) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    # Run ids start with a timestamp, so name order is age order.
    for entry in sorted(runs, key=lambda e: e.name)[:-KEEP_RUNS]:
        if not _still_running(entry.path):  # a days-long run outlives a hundred short ones
            shutil.rmtree(entry.path, ignore_errors=True)


def _still_running(log_dir: str) -> bool:
    """The call's summary says it runs, and the process running it is alive."""
    try:
        with open(paths.run_summary(log_dir)) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return False
    return private_files.call_still_running(summary) is True


class RankTail:
    """The last lines a rank printed, as a terminal shows them (carriage-return redraws collapsed)."""

    def __init__(self) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._splitter = LineSplitter()

    def add(self, text: str) -> None:
        # Only the end of a big chunk can reach the tail: skip to just after its (TAIL_LINES + 1)th
        # newline from the end (what comes before it is complete lines that would be dropped).
        cut = len(text)
        for _ in range(TAIL_LINES + 1):
            cut = text.rfind("\n", 0, cut)
            if cut < 0:
                break
        if cut > 0:
            self._splitter.flush()  # the unfinished line before the cut ended inside the skipped part
            text = text[cut + 1 :]
        for line in self._splitter.feed(text)[-TAIL_LINES:]:
            self.lines.append(visible(line))

    def last(self, n: int = 5) -> list[str]:
        lines = list(self.lines)
        rest = visible(self._splitter.rest())
        if rest.strip():
            lines.append(rest)
        return lines[-n:]


class OutputRouter:
    """Receives raw chunks from rank pipes; writes logs, emits events, keeps tails."""

    def __init__(self, log_dir: str, world_size: int, bus: EventBus):
        self.log_dir = log_dir
        self._bus = bus
        self._log_fds = [private_files.open_private(self.log_path(r)) for r in range(world_size)]
        self._decoders = {
            (r, s): codecs.getincrementaldecoder("utf-8")("replace")
            for r in range(world_size)
            for s in ("stdout", "stderr")
        }
        self._pending = {key: b"" for key in self._decoders}
        self.tails = [RankTail() for _ in range(world_size)]
        self.unlogged: dict[int, str] = {}  # rank -> why its log is no longer written

    def log_path(self, rank: int) -> str:
        return paths.rank_log(self.log_dir, rank)

    def feed(self, rank: int, stream: str, data: bytes) -> None:
        self._log(rank, stream, data)
        text = self._decoders[(rank, stream)].decode(data)
        if text:
            self.tails[rank].add(text)
            self._bus.emit(RankOutput(rank=rank, stream=stream, text=text))

    def _log(self, rank: int, stream: str, data: bytes) -> None:
        key = (rank, stream)
        pending = self._pending[key]
        cut = data.rfind(b"\n") + 1
        if cut:  # the unfinished line before, then the chunk's whole lines: one write, no copy
            self._write(rank, pending, memoryview(data)[:cut])
            pending = data[cut:]
        else:
            pending += data
        if len(pending) > MAX_PARTIAL:  # a line that never ends: written in pieces
            self._write(rank, pending)
            pending = b""
        self._pending[key] = pending

    def _write(self, rank: int, *parts: bytes | memoryview) -> None:
        if rank in self.unlogged:
            return
        try:
            _write_all(self._log_fds[rank], *parts)
        except OSError as exc:  # a full disk must not end the training, nor hide its output
            why = exc.strerror or str(exc)
            self.unlogged[rank] = why
            self._bus.emit(
                RankOutput(
                    rank=rank,
                    stream="stderr",
                    text=f"[air_magic] rank {rank}'s log {self.log_path(rank)} is cut short here ({why}): "
                    "its output is still shown, but no longer kept\n",
                )
            )

    def close(self) -> None:
        for (rank, _stream), pending in self._pending.items():
            if pending:
                self._write(rank, pending + b"\n")
        for (rank, stream), decoder in self._decoders.items():
            rest = decoder.decode(b"", final=True)
            if rest:
                self.tails[rank].add(rest)
                self._bus.emit(RankOutput(rank=rank, stream=stream, text=rest))
        for fd in self._log_fds:
            os.close(fd)
        self._log_fds = []


def _write_all(fd: int, *parts: bytes | memoryview) -> None:
    """Append ``parts`` in order, in one system call when the kernel takes them whole."""
    views = [memoryview(p) for p in parts if len(p)]
    while views:
        written = os.writev(fd, views)
        while views and written >= len(views[0]):
            written -= len(views.pop(0))
        if views:
            views[0] = views[0][written:]
