"""Plain-text display of a run: rank-prefixed lines on the caller's stdout/stderr.

Used in an IPython terminal, a script, and any frontend without widgets.
Output is split into lines per rank and stream; a carriage-return redraw
(tqdm) shows only its final state, and a line is printed once complete.

**Many ranks** (more than :data:`MANY_RANKS`, and no ranks chosen): a console
with every rank's lines is unreadable at 64 ranks and floods at 1,000. Then
the console shows rank 0's output live; each other rank keeps only the tail
of its output here (:data:`TAIL_CHARS`), printed at the end if that rank is
the root cause (the rank that failed first: at 1,000 ranks its peers' own
failures, "connection reset by peer", follow by hundreds); the others are
counted by how they ended, not listed. Every rank's whole output is in its log.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import TextIO

from air_magic.display.rank_board import (
    MANY_RANKS,
    on_nodes,
)  # past it, rank 0 and the root cause only (above)
from air_magic.protocol.events import (
    Event,
    RankExited,
    RankOutput,
    RankState,
    RecordLink,
    RunFinished,
    RunStarted,
    SessionState,
)
from air_magic.protocol.lines import LineSplitter, visible

TAIL_CHARS = 2000  # what is kept of a hidden rank's output, to print if it fails

_cpu_mode_said = False
_COLOURS = (36, 33, 35, 32, 34, 31, 96, 93, 95, 92, 94, 91)  # ANSI foreground codes, one per rank


class TextDisplay:
    def __init__(
        self,
        out: TextIO | None = None,
        err: TextIO | None = None,
        prefix_width: int = 0,
        ranks: set[int] | None = None,
        record: RecordLink | None = None,
        colour: bool = False,
    ):
        self._ranks = ranks  # None: every rank
        self._colour = colour  # each rank's prefix in its own colour (a terminal; never when piped)
        self._record = record
        self._out = out
        self._err = err
        self._splitters: dict[tuple[int, str], LineSplitter] = {}
        self._width = prefix_width
        self._summary = False  # many ranks: rank 0 live, failing ranks' tails, counts at the end
        self._tails: dict[int, str] = {}
        self._ended: Counter[str] = Counter()
        self._nodes: list[int] = []  # each rank's node (many ranks: failures are counted by node)
        self._failed_on: Counter[int] = Counter()

    def set_record(self, record: RecordLink | None) -> None:
        """The call's MLflow run, known once it exists (before the ranks start)."""
        self._record = record

    # sys.stdout is read at each write: IPython swaps it per cell.
    def _stream(self, name: str) -> TextIO:
        if name == "stderr":
            return self._err or sys.stderr
        return self._out or sys.stdout

    def handle(self, event: Event) -> None:
        if isinstance(event, RankOutput):
            self._output(event)
        elif isinstance(event, RecordLink):
            self.set_record(event)
        elif isinstance(event, RunStarted):
            self._width = len(str(event.world_size - 1))
            self._started(event)
        elif isinstance(event, RankExited):
            self._flush_rank(event.rank)
            if self._summary:
                self._exited_among_many(event)
            elif event.state is not RankState.SUCCEEDED:
                self._note(f"rank {event.rank} {event.state.value}: {event.reason}")
        elif isinstance(event, SessionState):
            if event.cells == 0:  # the session's start; each cell's tabs show it in their header
                self._note(event.describe())
        elif isinstance(event, RunFinished):
            for rank in sorted({r for r, _ in self._splitters}):
                self._flush_rank(rank)
            if self._summary:
                self._root_cause_tail(event.failed_rank)
                counts = ", ".join(f"{n} {how}" for how, n in self._ended.most_common())
                nodes = len(set(self._nodes))
                on = on_nodes(nodes)
                failed = ""
                if nodes > 1 and self._failed_on:
                    by_node = sorted(self._failed_on.items(), key=lambda item: (-item[1], item[0]))
                    failed = "; failed by node: " + ", ".join(f"node {n}: {c}" for n, c in by_node[:10])
                self._note(f"ranks{on}: {counts}{failed}")
            logs = f"; logs: {event.log_dir}" if event.log_dir else ""  # none: refused before it began
            self._note(f"{event.outcome} in {event.elapsed:.1f} s{logs}")

    def _started(self, event: RunStarted) -> None:
        global _cpu_mode_said
        where = f"{event.world_size} rank(s), backend {event.backend}"
        if event.cpu_mode and not _cpu_mode_said:
            _cpu_mode_said = True
            self._note(
                "CPU mode: no NVIDIA GPU is visible, so every rank runs on the CPU with gloo "
                "(air_magic.init_process_group() picks it; code that asks for 'nccl' fails here)"
            )
        elif not event.cpu_mode:
            where += f" on {event.detected}"
        self._note(f"running {event.name} on {where}")
        if self._ranks is None and event.world_size > MANY_RANKS:
            self._summary = True
            self._nodes = event.node_of()
            self._ranks = {0}
            self._note(
                f"{event.world_size} ranks: the console shows rank 0's output, and the last lines "
                f"of the rank that fails first; every rank's output is in its log ({event.log_dir})"
            )
        if self._record is not None:
            self._note(self._record.description)

    def _exited_among_many(self, event: RankExited) -> None:
        """Many ranks: counted by how they ended; a failed rank's tail kept until the root cause is known."""
        killed = event.state is RankState.KILLED
        self._ended[f"killed ({event.reason})" if killed else event.state.value] += 1
        if event.state is RankState.FAILED and event.rank < len(self._nodes):
            self._failed_on[self._nodes[event.rank]] += 1
        if event.state is not RankState.FAILED:
            self._tails.pop(event.rank, None)

    def _root_cause_tail(self, rank: int | None) -> None:
        """Many ranks: the last lines of the rank that failed first (its peers' failures followed)."""
        tail = self._tails.pop(rank, "").rstrip("\n") if rank is not None else ""
        if rank is not None and rank != 0:  # rank 0's lines were shown as they came
            self._note(f"rank {rank} failed first; its last lines:")
            if tail:
                self._write(rank, "stderr", "\n".join(tail.split("\n")[-20:]))

    def _output(self, event: RankOutput) -> None:
        if self._ranks is not None and event.rank not in self._ranks:
            if self._summary:  # kept short, for the case it fails
                self._tails[event.rank] = (self._tails.get(event.rank, "") + event.text)[-TAIL_CHARS:]
            return
        splitter = self._splitters.setdefault((event.rank, event.stream), LineSplitter())
        block = splitter.feed_block(event.text)
        if block is not None:
            self._write(event.rank, event.stream, block)

    def _flush_rank(self, rank: int) -> None:
        for stream in ("stdout", "stderr"):
            splitter = self._splitters.get((rank, stream))
            rest = splitter.flush() if splitter is not None else ""
            if rest:
                self._write(rank, stream, rest)

    def _write(self, rank: int, stream: str, block: str) -> None:
        """Write ``block`` (lines joined by newlines), each line behind the rank's prefix."""
        prefix = f"[rank {rank:>{self._width}}] "
        if self._colour:
            prefix = f"\x1b[{_COLOURS[rank % len(_COLOURS)]}m{prefix}\x1b[0m"
        if "\r" in block:  # a redrawn line shows as its last redraw
            block = "\n".join(visible(line) for line in block.split("\n"))
        # One write per chunk, prefixed in C: a flood of lines stays cheap.
        text = prefix + block.replace("\n", "\n" + prefix) + "\n"
        target = self._stream(stream)
        target.write(text)
        target.flush()

    def _note(self, text: str) -> None:
        target = self._stream("stderr")
        target.write(f"air_magic: {text}\n")
        target.flush()
