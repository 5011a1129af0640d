"""How a rank's output text becomes lines: the one splitter every reader of rank output uses.

Output arrives in chunks that split lines anywhere. :class:`LineSplitter`
hands back complete lines and keeps the unfinished end. A ``\\r`` returns to
the start of the line (how tqdm redraws a bar), so an unfinished line is kept
from its last ``\\r`` on: a bar redrawn for hours without a newline costs one
bar, not hours of text. An unfinished line longer than ``max_partial`` is
handed back as a line of its own, so memory stays bounded whatever a rank
prints. :func:`visible` is what a terminal shows of a line.
"""

from __future__ import annotations

MAX_PARTIAL = 64 * 1024  # characters: far longer than any line a person reads, short enough to hold per rank


class LineSplitter:
    def __init__(self, max_partial: int = MAX_PARTIAL):
        self.max_partial = max_partial
        self._rest = ""

    def feed(self, text: str) -> list[str]:
        """The lines ``text`` completes (without their ``\\n``), in order."""
        *lines, rest = (self._rest + text).split("\n")
        self._rest = _from_last_redraw(rest)
        if len(self._rest) > self.max_partial:
            lines.append(self._rest)
            self._rest = ""
        return lines

    def feed_block(self, text: str) -> str | None:
        """What :meth:`feed` returns, as one string (the lines joined by ``\\n``), or None for no line.

        For a reader that handles lines in bulk (a flood is thousands per chunk):
        no list of line objects is made.
        """
        cut = text.rfind("\n")
        if cut < 0:
            lines = self.feed(text)  # no newline: at most the over-long unfinished line comes back
            return lines[0] if lines else None
        done = self._rest + text[:cut]
        self._rest = _from_last_redraw(text[cut + 1 :])
        if len(self._rest) > self.max_partial:
            done += "\n" + self._rest
            self._rest = ""
        return done

    def rest(self) -> str:
        """The unfinished line so far."""
        return self._rest

    def flush(self) -> str:
        """Take the unfinished line (at the end of the output)."""
        rest, self._rest = self._rest, ""
        return rest


def visible(line: str) -> str:
    """What a terminal shows of ``line``: the text after its last ``\\r`` (a trailing one erases nothing)."""
    if "\r" not in line:
        return line
    return line.rstrip("\r").rsplit("\r", 1)[-1]


def _from_last_redraw(partial: str) -> str:
    """``partial`` without what a later ``\\r`` has already overwritten (same :func:`visible` result)."""
    cut = partial.rfind("\r", 0, len(partial) - 1)  # a trailing \r does not overwrite yet
    return partial if cut < 0 else partial[cut:]
