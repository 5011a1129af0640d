"""``air-magic run --json``: one JSON object per event on stdout, for programs that read a call.

Objects (each on its own line, ``"event"`` first): ``run_started``, ``rank_started``,
``line`` (one whole line a rank wrote, with its ``stream``), ``rank_exited``,
``run_finished``; the command line adds ``result`` at the end (values or error,
exit status, the MLflow run). Rank output is split into lines exactly as the
text display splits it (protocol/lines.py); an unfinished line is sent when
its rank exits.

Every line parses with a strict JSON parser: a non-finite float (a loss that went
``nan``) is written as the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (as
protobuf's JSON mapping does), never as the bare ``NaN`` that Python's json writes;
a value JSON has no type for is written as its ``repr``.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any, TextIO

from air_magic.protocol.events import Event, RankExited, RankOutput, RankStarted, RunFinished, RunStarted
from air_magic.protocol.lines import LineSplitter


def _strict(value: Any) -> Any:
    """``value`` with every non-finite float as its name, in lists, tuples and dicts at any depth."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(_strict(k)): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def _as_text(value: Any) -> Any:
    return repr(value)


class JsonLines:
    def __init__(self, out: TextIO | None = None):
        self._out = out
        self._splitters: dict[tuple[int, str], LineSplitter] = {}

    def handle(self, event: Event) -> None:
        if isinstance(event, RankOutput):
            splitter = self._splitters.setdefault((event.rank, event.stream), LineSplitter())
            for line in splitter.feed(event.text):
                self.emit("line", rank=event.rank, stream=event.stream, text=line)
        elif isinstance(event, RunStarted):
            self.emit(
                "run_started",
                run_id=event.call_id,  # the lines' key, as their readers know it
                name=event.name,
                world_size=event.world_size,
                backend=event.backend,
                cpu_mode=event.cpu_mode,
                log_dir=event.log_dir,
            )
        elif isinstance(event, RankStarted):
            self.emit("rank_started", rank=event.rank, pid=event.pid)
        elif isinstance(event, RankExited):
            self._flush(event.rank)
            self.emit(
                "rank_exited",
                rank=event.rank,
                state=event.state.value,
                exit_code=event.exit_code,
                reason=event.reason,
            )
        elif isinstance(event, RunFinished):
            for rank in sorted({rank for rank, _ in self._splitters}):
                self._flush(rank)
            self.emit(
                "run_finished",
                run_id=event.call_id,
                outcome=event.outcome,
                elapsed=round(event.elapsed, 3),
                log_dir=event.log_dir,
                error=event.error,
                failed_rank=event.failed_rank,
            )

    def emit(self, kind: str, **fields: Any) -> None:
        out = self._out or sys.stdout
        out.write(json.dumps(_strict({"event": kind, **fields}), default=_as_text, allow_nan=False) + "\n")
        out.flush()

    def _flush(self, rank: int) -> None:
        for stream in ("stdout", "stderr"):
            splitter = self._splitters.get((rank, stream))
            rest = splitter.flush() if splitter is not None else ""
            if rest:
                self.emit("line", rank=rank, stream=stream, text=rest)
