"""A call's events as JSON lines in a file: a detached run's supervisor writes it, an attach reads it.

The supervisor (``calls/supervisor.py``) adds :class:`EventLogWriter` to its
call's consumers; whoever attaches (``calls/detached.py``) reads the file from
its start with :func:`follow` and hands each event to its own displays: what
was printed so far, then the stream, through the same consumers a live call
uses. Every event but ``Tick`` is kept, rank output as it came (carriage returns
and unfinished lines included), so a replay draws exactly what a live view drew.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO

from air_magic.protocol.events import (
    Event,
    RankExited,
    RankOutput,
    RankStarted,
    RankState,
    RunFinished,
    RunStarted,
    Tick,
)

_KINDS: dict[str, type[Any]] = {
    cls.__name__: cls for cls in (RunStarted, RankStarted, RankOutput, RankExited, RunFinished)
}
FLUSH_S = 0.2  # rank output reaches the file (and a follower) at most this late


def to_line(event: Event) -> str:
    fields = dataclasses.asdict(event)
    if isinstance(event, RankExited):
        fields["state"] = event.state.value
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
        event: Event = cls(**fields)
        return event
    except (ValueError, KeyError, TypeError):
        return None


class EventLogWriter:
    """A consumer that appends every event (but ``Tick``) to ``path``; flushed at least every FLUSH_S."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        self._file: TextIO = os.fdopen(fd, "a", encoding="utf-8")
        self._flushed = time.monotonic()

    def handle(self, event: Event) -> None:
        if not isinstance(event, Tick):
            self._file.write(to_line(event))
        now = time.monotonic()
        if not isinstance(event, RankOutput) or now - self._flushed >= FLUSH_S:
            self._file.flush()
            self._flushed = now
        if isinstance(event, RunFinished):
            self._file.close()


def follow(path: str, stop: threading.Event, poll_s: float = 0.1) -> Iterator[Event | None]:
    """Every event in ``path`` from its start, then each new one as it is written, until the
    ``RunFinished`` event or ``stop`` is set; ``None`` each ``poll_s`` without news (the
    follower's moment to refresh and to check that the writer still lives). A line still
    being written waits for its end."""
    with open(path, encoding="utf-8", errors="replace") as f:
        partial = ""
        while not stop.is_set():
            chunk = f.readline()
            if not chunk:
                yield None
                time.sleep(poll_s)
                continue
            partial += chunk
            if not partial.endswith("\n"):
                continue
            event = from_line(partial)
            partial = ""
            if event is None:
                continue
            yield event
            if isinstance(event, RunFinished):
                return
