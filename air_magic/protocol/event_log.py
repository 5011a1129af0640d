"""A call's events as JSON lines in files: a detached run's supervisor writes them, an attach reads them.

The supervisor (``calls/supervisor.py``) adds :class:`EventLogWriter` to its
call's consumers; whoever attaches (``calls/detached.py``, ``calls/ray_jobs.py``)
reads them with :func:`follow` and hands each event to its own displays: what
was printed so far, then the stream, through the same consumers a live call
uses. Every event but ``Tick``, ``RankMetrics`` (the supervisor stores those) and
``CellAnswered`` (a session is never detached) is kept, rank output as it came
(carriage returns and unfinished lines included), so a replay draws exactly what
a live view drew.

The log is written in parts, so that a follower never replays an unbounded file
(a follower of a Ray job reads them over HTTP): ``events.jsonl``, then
``events.1.jsonl``, ``events.2.jsonl``... Once a part holds ``PART_BYTES``, the
writer ends it with a ``NextPart`` line and starts the next with a snapshot of
the ranks (the ``RecordLink`` and ``RunStarted`` events, every ``RankStarted`` and ``RankExited``
so far) before the new events. A follower starts at a recent part: the
snapshot gives it every rank's state, the part the latest output (the ranks'
whole output is in their log files). A follower starts one part before the newest
(which may have just begun): it replays at most two parts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from air_magic.protocol.events import (
    CellAnswered,
    Event,
    RankExited,
    RankMetrics,
    RankOutput,
    RankStarted,
    RankState,
    RecordLink,
    RunFinished,
    RunStarted,
    Tick,
)

_KINDS: dict[str, type[Any]] = {
    cls.__name__: cls for cls in (RecordLink, RunStarted, RankStarted, RankOutput, RankExited, RunFinished)
}
FLUSH_S = 0.2  # rank output reaches the file (and a follower) at most this late
PART_BYTES = 8 * 2**20  # what a follower replays at most, beyond the ranks' snapshot
PENDING_MAX = 16 * 2**20  # a full disk: events held in memory at most, beyond which rank output is dropped
ROOM_POLL_S = 0.5  # at the end, on a full disk: how often the writer tries again
FIRST_PART = "events.jsonl"
_PART = re.compile(r"^events(?:\.(\d+))?\.jsonl$")
_NEXT_PART = "NextPart"

Lines = Iterator[str | None]  # a part's lines as written, None each time there is nothing new yet


def part_name(part: int) -> str:
    return FIRST_PART if part == 0 else f"events.{part}.jsonl"


def part_number(name: str) -> int | None:
    """The part a file name is (``events.jsonl``: 0), or None for another file."""
    found = _PART.match(name)
    if found is None:
        return None
    return int(found.group(1) or 0)


def replay_from(names: Any) -> int:
    """The part a new follower starts at, given the file ``names`` in the folder: the one before
    the newest (the newest may have just begun), so at most two parts are replayed."""
    parts = [p for p in (part_number(os.path.basename(n)) for n in names) if p is not None]
    return max(max(parts, default=0) - 1, 0)


def to_line(event: Event) -> str:
    fields = dataclasses.asdict(event)
    if isinstance(event, RankExited):
        fields["state"] = event.state.value
    if isinstance(event, (RunStarted, RunFinished)):  # the key every version reads (and writes)
        fields["run_id"] = fields.pop("call_id")
    return json.dumps({"kind": type(event).__name__, **fields}) + "\n"


def from_line(line: str) -> Event | None:
    """The event a line holds; None for a line that is not one (torn, or of a later version)."""
    try:
        fields = json.loads(line)
        cls = _KINDS[fields.pop("kind")]
        if cls is RankExited:
            fields["state"] = RankState(fields["state"])
        if cls is RunStarted and "ranks_per_node" in fields:
            fields["ranks_per_node"] = tuple(fields["ranks_per_node"])
        if cls in (RunStarted, RunFinished) and "run_id" in fields:  # a log written before call_id
            fields["call_id"] = fields.pop("run_id")
        event: Event = cls(**fields)
        return event
    except (ValueError, KeyError, TypeError):
        return None


def _next_part_of(line: str) -> int | None:
    if _NEXT_PART not in line[:32]:
        return None
    try:
        fields = json.loads(line)
        return int(fields["part"]) if fields.get("kind") == _NEXT_PART else None
    except (ValueError, KeyError, TypeError):
        return None


def _snapshot_key(event: Event) -> Any:
    if isinstance(event, RecordLink):
        return "record"
    if isinstance(event, RunStarted):
        return "run"
    if isinstance(event, (RankStarted, RankExited)):
        return (type(event).__name__, event.rank)
    return None


class EventLogWriter:
    """A consumer that appends every event (but ``Tick``) to the parts in ``folder``; flushed at
    least every FLUSH_S.

    A full disk never stops the call: what does not fit waits in memory and goes out, whole lines in
    order, at the next write that finds room (:meth:`flush`; the supervisor waits for it at the end).
    Past :data:`PENDING_MAX` waiting, rank output is dropped (each rank's log file has it all) and
    every other event still kept, so a follower always learns the ranks' states and the end."""

    def __init__(self, folder: str, part_bytes: int = PART_BYTES) -> None:
        self._folder = folder
        self._part_bytes = part_bytes
        self._part = 0
        self._written = 0
        self._fd = self._open(0)
        self._pending = bytearray()  # for this part, not on disk yet (a full disk)
        # Moving to the next part (its snapshot written) while the end of this one waits for room:
        # its fd, and the events that go to it.
        self._moving: int | None = None
        self._after = bytearray()
        self.dropped = 0  # rank output events dropped while the disk stayed full
        self._closed = False
        self._flushed = time.monotonic()
        self._snapshot: dict[Any, Event] = {}  # RunStarted, RankStarted, RankExited so far: a part starts so

    def _open(self, part: int) -> int:
        path = os.path.join(self._folder, part_name(part))
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)

    def handle(self, event: Event) -> None:
        if not isinstance(event, (Tick, RankMetrics, CellAnswered)):
            key = _snapshot_key(event)
            if key is not None:
                self._snapshot[key] = event
            data = to_line(event).encode("utf-8", "replace")
            queue = self._after if self._moving is not None else self._pending
            waiting = len(self._pending) + len(self._after)
            if isinstance(event, RankOutput) and waiting + len(data) > PENDING_MAX:
                self.dropped += 1
            else:
                queue += data
                self._written += len(data)
            if self._written >= self._part_bytes and not isinstance(event, RunFinished) and self.flush():
                self._next_part()
        now = time.monotonic()
        if not isinstance(event, RankOutput) or now - self._flushed >= FLUSH_S:
            self.flush()
            self._flushed = now
        if isinstance(event, RunFinished) and not self._pending and self._moving is None:
            self.close()  # else the supervisor waits for room (finish())

    def finish(self, wait_s: float) -> bool:
        """The call has ended: wait up to ``wait_s`` for room to write what still waits; True if
        it all went (else what waits is lost: a follower says the run was lost)."""
        deadline = time.monotonic() + wait_s
        while not self._closed and not self.flush() and time.monotonic() < deadline:
            time.sleep(ROOM_POLL_S)
        done = not self._pending and self._moving is None
        self.close()
        return done

    def flush(self) -> bool:
        """Write what waits; True once all of it is on disk (a full disk keeps the rest for later)."""
        if self._closed:
            return not self._pending
        while True:
            while self._pending:
                try:
                    written = os.write(self._fd, self._pending)
                except OSError:
                    return False
                del self._pending[:written]
            if self._moving is None:
                return True
            os.close(self._fd)  # this part is whole, its NextPart line last: on to the next
            self._fd, self._moving = self._moving, None
            self._pending, self._after = self._after, bytearray()
            self._part += 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        os.close(self._fd)
        if self._moving is not None:
            os.close(self._moving)

    def _next_part(self) -> None:
        """Open the next part with the snapshot first, then end this one: a follower that moves on
        finds the next part whole from its first line. No room for the snapshot: this part goes on."""
        name = os.path.join(self._folder, part_name(self._part + 1))
        snapshot = "".join(to_line(e) for e in self._snapshot.values()).encode("utf-8", "replace")
        try:
            following = self._open(self._part + 1)
        except OSError:
            return
        try:
            _write_all(following, snapshot)
        except OSError:
            os.close(following)
            os.unlink(name)  # never a part without its whole snapshot
            return
        self._moving = following
        self._pending += (json.dumps({"kind": _NEXT_PART, "part": self._part + 1}) + "\n").encode()
        self._written = len(snapshot)
        self.flush()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def file_lines(path: str, stop: threading.Event, poll_s: float = 0.1) -> Lines:
    """The lines of a file as they are written (``None`` each ``poll_s`` without news), until ``stop``."""
    with open(path, encoding="utf-8", errors="replace") as f:
        while not stop.is_set():
            line = f.readline()
            if line:
                yield line
            else:
                yield None
                time.sleep(poll_s)


def follow(
    lines_of: Callable[[int], Lines], first_part: int, stop: threading.Event
) -> Iterator[Event | None]:
    """Every event from part ``first_part`` on (``lines_of(part)`` gives a part's lines as they are
    written), then each new one, until the ``RunFinished`` event or ``stop`` is set; ``None`` for
    each stretch without news (the follower's moment to refresh and to check that the writer
    still lives). A line still being written waits for its end."""
    part = first_part
    seen: set[Any] = set()
    while not stop.is_set():
        partial = ""
        moved = False
        for chunk in lines_of(part):
            if stop.is_set():
                return
            if chunk is None:
                yield None
                continue
            partial += chunk
            if not partial.endswith("\n"):
                continue
            line, partial = partial, ""
            following = _next_part_of(line)
            if following is not None:
                part, moved = following, True
                break
            event = from_line(line)
            if event is None:
                continue
            key = _snapshot_key(event)
            if key is not None:
                if key in seen:  # a new part's snapshot, seen already in the one before
                    continue
                seen.add(key)
            yield event
            if isinstance(event, RunFinished):
                return
        if not moved:
            return  # the lines ended (the writer is gone, or a stream closed): the follower decides
