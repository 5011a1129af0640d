"""A rank's output as a terminal would show it: lines, carriage-return redraws, a capped tail.

Used by the widget display. Text arrives in chunks that split lines
anywhere; a ``\\r`` returns to the start of the current line, so the next
text replaces it (that is how tqdm redraws a bar). We keep the text after
the last ``\\r`` of a line, which is what the eye sees for any progress bar
that rewrites its whole line. ANSI colour codes are kept: Jupyter renders
them in stream outputs. Only the last :data:`MAX_LINES` lines are kept here;
the full log is on disk.

A line redrawn with ``\\r`` on stderr (tqdm's bar, which writes to stderr) is shown
as stdout: it is progress, and Jupyter shades stderr like an error. Text that is
not redrawn keeps its stream (a traceback stays shaded).
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field

from air_magic.protocol.lines import LineSplitter, visible

MAX_LINES = 1000  # per rank: what a person scrolls through; the log on disk has everything
MAX_LINE_CHARS = 10_000  # a longer line (a tensor printed whole) is cut for the browser, not the log


@dataclass
class RankScreen:
    max_lines: int = MAX_LINES
    max_line_chars: int = MAX_LINE_CHARS
    lines: collections.deque[tuple[str, str]] = field(default_factory=collections.deque)
    dropped: int = 0
    _splitters: dict[str, LineSplitter] = field(default_factory=dict)

    def write(self, stream: str, text: str) -> None:
        # An unfinished line is kept up to the line cap too (longer, it is cut as a line is).
        splitter = self._splitters.setdefault(stream, LineSplitter(max_partial=self.max_line_chars))
        lines = splitter.feed(text)
        if len(lines) > self.max_lines:  # a flood's chunk: only its end can stay on the screen
            self.dropped += len(lines) - self.max_lines
            lines = lines[-self.max_lines :]
        for line in lines:
            self._append(_shown_as(stream, line), visible(line))

    def _append(self, stream: str, line: str) -> None:
        cap = self.max_line_chars
        if len(line) > cap:
            line = line[:cap] + f" … ({len(line) - cap} more characters in the log)"
        self.lines.append((stream, line))
        if len(self.lines) > self.max_lines:
            self.lines.popleft()
            self.dropped += 1

    def stream_outputs(self, last: int | None = None) -> tuple[dict[str, str], ...]:
        """The screen as Jupyter stream outputs: consecutive lines of one stream merged.

        ``last``: only the last lines, after one saying how many earlier ones the log has (a tab
        shows its top first: a short tail shows the end, a traceback say, without scrolling)."""
        partial = [
            (_shown_as(s, split.rest()), visible(split.rest())[-self.max_line_chars :])
            for s, split in self._splitters.items()
        ]
        rows = list(self.lines) + [(s, p) for s, p in partial if p]
        if last is not None and len(rows) + self.dropped > last:
            earlier = len(rows) + self.dropped - last
            rows = [("stdout", f"… {earlier} earlier line(s) in the log"), *rows[-last:]]
        outputs: list[dict[str, str]] = []
        for stream, group in itertools.groupby(rows, key=lambda row: row[0]):
            text = "".join(line + "\n" for _, line in group)
            outputs.append({"output_type": "stream", "name": stream, "text": text})
        return tuple(outputs)

    def text(self) -> str:
        return "".join(o["text"] for o in self.stream_outputs())


def _shown_as(stream: str, line: str) -> str:
    """The stream a line is shown as: a redrawn stderr line is progress, not an error (see above)."""
    return "stdout" if stream == "stderr" and "\r" in line.rstrip("\r") else stream  # not a CRLF end
