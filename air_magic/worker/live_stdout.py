"""A rank's stdout: every print reaches the caller at once, until the rank floods it.

Ranks run with ``PYTHONUNBUFFERED=1`` (worker/entry.py's caller sets it, as
``python -u`` would): each ``print`` is two ``write`` calls on the rank's stdout
pipe and wakes the caller. That is what a user debugging with prints wants (a
line printed just before a segfault or ``os._exit`` is never lost), and what a
flood cannot afford: 200 000 lines cost a rank 4-5 times what writing them to
/dev/null does (docs/benchmarks.md, "Output streaming").

So :func:`start` watches the rank's write rate (``syscw`` in /proc/self/io,
read every :data:`_TICK_S`). Past :data:`FLOOD_WRITES_PER_S` the rank's own
``sys.stdout`` object is reconfigured in place to buffer (``write_through``
off: 64 KiB chunks) and this module's thread flushes it every
:data:`_TICK_S`, so output stays live within that; after :data:`_QUIET_TICKS`
ticks with nothing to flush it writes through again. What this trades, and
only during a flood: a rank that dies without Python's exit (SIGKILL, a
segfault, ``os._exit``, ``exec``) can lose its last tick of stdout, and a
stderr line may show up to one tick before stdout lines printed just ahead of
it (stderr is never buffered). docs/architecture.md, "Rank output".

The stream object is never replaced (objects holding it stay right), a stream
the user reconfigured is left to them, a fork of the rank writes through (it
has no flusher thread), and the rank's exit flushes (entry._exit,
:func:`finish` from the last atexit hook). The same code runs in fresh and warm
ranks, which start with identical streams (starter_main mirrors ``-u``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any

FLOOD_WRITES_PER_S = 1000  # below it, write-through costs a rank well under 1 % (about 2 µs a write)
_TICK_S = 0.02  # how late buffered output may reach the caller
_QUIET_TICKS = 10  # a flood that stopped for this many ticks: back to writing through
_CHUNK = 1 << 16  # the text layer's chunk while buffering (its default, 8 KiB, costs 8 times the writes)

_live: _LiveStdout | None = None


def start() -> None:
    """Watch this rank's stdout (once per process); no-op where /proc/self/io cannot be read."""
    global _live
    stream = sys.stdout
    if _live is not None or stream is None or not _writes_through(stream):
        return
    try:
        counters = os.open("/proc/self/io", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no task I/O accounting here: write through, as before
        return
    _live = _LiveStdout(stream, counters)
    os.register_at_fork(before=_live.flush, after_in_child=_live.after_fork_in_child)
    threading.Thread(target=_live.run, name="air_magic-stdout", daemon=True).start()


def finish() -> None:
    """The rank is ending: write through from now on, and flush what waits (any thread may call it)."""
    if _live is not None:
        _live.stop()


def flush() -> None:
    """Flush the rank's stdout, even when the user has replaced ``sys.stdout`` (before a traceback)."""
    if _live is not None:
        _live.flush()


def _writes_through(stream: Any) -> bool:
    try:
        return bool(stream.write_through) and not stream.line_buffering
    except AttributeError:  # not a TextIOWrapper: somebody else's stream, left alone
        return False


class _LiveStdout:
    def __init__(self, stream: Any, counters: int):
        self.stream = stream
        self.counters = counters
        self.buffering = False
        self.done = threading.Event()
        self.lock = threading.Lock()  # a mode change and the end of the rank never cross
        self.default_chunk = stream._CHUNK_SIZE

    def run(self) -> None:
        last = self._counts()[0]
        quiet = 0
        while not self.done.wait(_TICK_S):
            if not self._still_ours():
                return  # the user reconfigured the stream: theirs from now on
            if not self.buffering:
                writes = self._counts()[0]
                if writes - last > FLOOD_WRITES_PER_S * _TICK_S:
                    with self.lock:
                        if self.done.is_set():
                            return
                        self._buffer(True)
                    quiet = 0
                last = writes
                continue
            before = self._counts()[1]
            self.flush()
            quiet = 0 if self._counts()[1] > before else quiet + 1
            if quiet >= _QUIET_TICKS:
                with self.lock:
                    self._buffer(False)
                last = self._counts()[0]

    def _counts(self) -> tuple[int, int]:
        """(write calls, bytes written) by this process so far."""
        try:
            text = os.pread(self.counters, 512, 0)
        except OSError:
            return 0, 0
        fields = dict(line.split(b": ") for line in text.splitlines() if b": " in line)
        return int(fields.get(b"syscw", 0)), int(fields.get(b"wchar", 0))

    def _still_ours(self) -> bool:
        stream = self.stream
        return not stream.line_buffering and stream.write_through == (not self.buffering)

    def _buffer(self, on: bool) -> None:
        with contextlib.suppress(Exception):  # a closed stream: nothing left to manage
            self.stream._CHUNK_SIZE = _CHUNK if on else self.default_chunk
            self.stream.reconfigure(write_through=not on)  # flushes first
        self.buffering = on

    def flush(self) -> None:
        with contextlib.suppress(Exception):  # closed, or a broken pipe: as a print would find it
            self.stream.flush()

    def stop(self) -> None:
        with self.lock:
            self.done.set()
            if self.buffering:
                self._buffer(False)
        self.flush()

    def after_fork_in_child(self) -> None:
        """A fork of the rank has no flusher thread: it writes through, and watches nothing."""
        global _live
        _live = None
        self.done.set()
        if self.buffering:
            self._buffer(False)
        with contextlib.suppress(OSError):
            os.close(self.counters)  # /proc/self in the parent's name: wrong for the child
