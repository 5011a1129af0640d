"""A rank's stdout: every print reaches the caller at once, until the rank floods it.

Ranks run as ``python -u`` would (``PYTHONUNBUFFERED=1``): each ``print`` is
two ``write`` calls on the rank's stdout pipe and wakes the caller. That is what
a user debugging with prints wants (a line printed just before a segfault or
``os._exit`` is never lost), and what a flood cannot afford: 200 000 lines
cost a rank 4-5 times what writing them to /dev/null does (docs/benchmarks.md,
"Output streaming").

So the rank's ``sys.stdout`` (made by :func:`make_stdout`, the same object in
fresh and warm ranks) writes through a :class:`StdoutWriter`, which counts its
writes, lets one thread write at a time (a flush from this module's thread and
a print of the rank's own never splice their bytes in the pipe) and writes
every byte (a short write to a full pipe is finished, not dropped).
:func:`start` watches the count every :data:`_TICK_S`: past
:data:`FLOOD_WRITES_PER_S` the text layer is reconfigured in place to buffer
(``write_through`` off, 64 KiB chunks) and flushed every tick, so output stays
live within that; after :data:`_QUIET_TICKS` ticks with nothing to flush it
writes through again. What this trades, and only during a flood: a rank that
dies without Python's exit (SIGKILL, a segfault, ``os._exit``, ``exec``) can
lose its last tick of stdout, and a stderr line, or a descriptor-level write
(C ``printf``), may show up ahead of stdout lines printed just before it
(stderr is never buffered). docs/architecture.md, "A rank's stdout is written
through until it floods".

A flood is noticed at once: the writer wakes the watcher when the tick's count
passes the threshold. A stream the user reconfigured is left to them; a fork of the rank writes
through (it has no flusher thread); the rank's exit, its traceback and
:func:`finish` (from the last atexit hook) flush and wait for a write in flight.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
from typing import Any

FLOOD_WRITES_PER_S = 1000  # below it, write-through costs a rank well under 1 % (a few µs a write)
_TICK_S = 0.02  # how late buffered output may reach the caller
_QUIET_TICKS = 10  # a flood that stopped for this many ticks: back to writing through
_CHUNK = 1 << 16  # the text layer's chunk while buffering (its default, 8 KiB, costs 8 times the writes)

_live: _LiveStdout | None = None
_writer: StdoutWriter | None = None  # the rank's, for the fork hook (a fork of a fork too)


class StdoutWriter(io.FileIO):
    """File descriptor 1 for a rank's text stdout: one writer at a time, every byte, writes counted."""

    def __init__(self, fd: int = 1):
        super().__init__(fd, "w", closefd=False)
        self.lock = threading.Lock()
        self.writes = 0
        # The watcher's alarm: set at this write count (a flood has begun: switch now, not at
        # the end of the tick, which costs a short flood a tick of unbuffered writes).
        self.alarm_at = -1
        self.alarm: threading.Event | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        with self.lock:
            self.writes += 1
            if self.writes == self.alarm_at and self.alarm is not None:
                self.alarm.set()
            done = 0
            while done < len(view):
                written = super().write(view[done:])
                if written is None:  # a non-blocking descriptor that is full: as FileIO says it
                    raise BlockingIOError(11, "write could not complete without blocking", done)
                done += written
            return done

    def wait_idle(self) -> None:
        """Return once no write is in flight (another thread's flush, say)."""
        with self.lock:
            pass


def make_stdout(like: Any) -> io.TextIOWrapper:
    """The rank's stdout: what ``python -u`` makes (written through), over a :class:`StdoutWriter`.

    ``like`` (the interpreter's own stdout, which never closes fd 1) gives the encoding and
    the error handler.
    """
    return io.TextIOWrapper(
        StdoutWriter(1),
        encoding=like.encoding,
        errors=like.errors,
        write_through=True,
        line_buffering=False,
    )


def start() -> None:
    """Give this rank the live stdout (a fresh rank's is replaced here; a warm starter made its own)."""
    global _live, _writer
    if _live is not None or sys.stdout is None:
        return
    if not isinstance(getattr(sys.stdout, "buffer", None), StdoutWriter):
        sys.stdout = sys.__stdout__ = make_stdout(sys.stdout)  # type: ignore[misc]
    _live = _LiveStdout(sys.stdout)
    _writer = _live.raw
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    threading.Thread(target=_live.run, name="air_magic-stdout", daemon=True).start()


def finish() -> None:
    """The rank is ending: write through from now on, flush, wait for the last write."""
    if _live is not None:
        _live.stop()


def flush() -> None:
    """Flush the rank's stdout (even when the user replaced ``sys.stdout``) and wait for the write."""
    if _live is not None:
        _live.flush()


class _LiveStdout:
    def __init__(self, stream: Any):
        self.stream = stream
        self.raw: StdoutWriter = stream.buffer
        self.buffering = False
        self.done = threading.Event()
        self.wake = threading.Event()  # a tick, the writer's flood alarm, or the end
        self.lock = threading.Lock()  # a mode change and the end of the rank never cross
        self.default_chunk = stream._CHUNK_SIZE
        self.thread: threading.Thread | None = None

    def run(self) -> None:
        self.thread = threading.current_thread()
        self.raw.alarm = self.wake
        per_tick = int(FLOOD_WRITES_PER_S * _TICK_S)
        last = self.raw.writes
        self.raw.alarm_at = last + per_tick + 1
        quiet = 0
        while True:
            self.wake.wait(_TICK_S)
            self.wake.clear()
            if self.done.is_set() or not self._still_ours():
                return  # the end, or the user reconfigured the stream: theirs from now on
            if self.buffering:
                self._flush_stream()
            writes = self.raw.writes  # since the last tick: the rank's own and the flush's
            if not self.buffering and writes - last > per_tick:
                with self.lock:
                    if self.done.is_set():
                        return
                    self._buffer(True)
                quiet = 0
            elif self.buffering:
                quiet = 0 if writes > last else quiet + 1
                if quiet >= _QUIET_TICKS:
                    with self.lock:
                        self._buffer(False)
            last = self.raw.writes
            self.raw.alarm_at = -1 if self.buffering else last + per_tick + 1

    def _still_ours(self) -> bool:
        stream = self.stream
        return not stream.line_buffering and stream.write_through == (not self.buffering)

    def _buffer(self, on: bool) -> None:
        try:
            self.stream._CHUNK_SIZE = _CHUNK if on else self.default_chunk
            self.stream.reconfigure(write_through=not on)  # flushes first
        except Exception:  # noqa: BLE001 - a closed stream: nothing left to manage
            self.done.set()
            return
        self.buffering = on

    def _flush_stream(self) -> None:
        with contextlib.suppress(Exception):  # closed, or a broken pipe: as a print would find it
            self.stream.flush()

    def flush(self) -> None:
        self._flush_stream()
        self.raw.wait_idle()  # the flusher's write, if one is in flight, is in the pipe too

    def stop(self) -> None:
        with self.lock:
            self.done.set()
            self.wake.set()
            if self.buffering:
                self._buffer(False)
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)  # it ends within a tick, unless a full pipe holds its write
        self.flush()


def _before_fork() -> None:
    if _live is not None:
        _live.flush()


def _after_fork_in_child() -> None:
    """A fork of the rank: no flusher thread, so it writes through; the writer's lock is its own."""
    global _live
    if _writer is not None:
        _writer.lock = threading.Lock()  # a parent's thread may have held it at the fork
        _writer.alarm, _writer.alarm_at = None, -1
    live, _live = _live, None
    if live is not None:
        live.done.set()
        live.lock = threading.Lock()
        if live.buffering:
            live._buffer(False)
