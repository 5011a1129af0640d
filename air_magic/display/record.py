"""The call's outcome as a static record: HTML and plain text beside the live tabs.

The widget view renders only where a frontend has the widget manager and the
widget's state: not in an nbconvert or GitHub export, not in a notebook reopened
in VS Code later, not in a frontend without the extension. There a notebook
shows the next richest form of the same output. The widget display therefore
puts this record next to its view (``text/html`` and ``text/plain`` in the one
display bundle) and replaces it at the end, through the display's id, with the
outcome: each rank's state, time and exit reason, its last lines, the log
folder and the run's link. A saved notebook thus keeps a readable account of
the run wherever it is opened.

A call that outlives its cell (a background run, a detached run followed here) ends after its
cell did, when a frontend that keeps only what comes while a cell runs (nbclient, so ``jupyter
nbconvert --execute`` and papermill) no longer listens to that cell: the record is rewritten at
the end of every later cell instead (``widgets.rewrite_at_cell_ends``), and until the call has
ended its ``note`` says when it was written.

Past ``MANY_RANKS`` ranks the record summarises as the live view does: the counts
by state, then rank 0, the rank that failed first, the other failed ranks and two
stopped ones (at most :data:`LISTED_OF_MANY` in all) with their last lines; every
rank's whole output is in its log.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

from air_magic.display.rank_board import MANY_RANKS, on_nodes
from air_magic.protocol.events import RankState, RecordLink

LAST_LINES = 20  # per rank in the record: the end of the story; the log has it all
RECORD_LINE_CHARS = 300  # a line of the record (the tabs cut at screen.MAX_LINE_CHARS)
LISTED_OF_MANY = 10  # ranks a record of many ranks lists: rank 0 and the failures first


@dataclass(frozen=True)
class RankRow:
    rank: int
    state: RankState
    took: str  # "12.3 s", or "" before it started
    reason: str
    last_lines: Sequence[str]


@dataclass(frozen=True)
class Record:
    name: str
    world_size: int
    mode: str  # "CPU mode, gloo" or "GPU_2xH100, nccl"
    outcome: str
    elapsed: float
    log_dir: str | None
    link: RecordLink | None
    rows: Sequence[RankRow]  # every rank's, or for many ranks those :func:`shown_ranks` picks
    cpu_mode: bool = False
    counts: str = ""  # "990 succeeded, 1 failed, 9 killed": said when ``rows`` are not every rank
    nodes: int = 1
    note: str = ""  # "still running at 14:03:05, ...": a record written before the call ended


def shown_ranks(states: Sequence[RankState], root_cause: int | None) -> list[int]:
    """The ranks a record lists, in that order: every rank up to ``MANY_RANKS``; past it rank 0, the
    rank that failed first, the other failed ranks and two stopped ones, at most LISTED_OF_MANY."""
    n = len(states)
    if n <= MANY_RANKS:
        return list(range(n))
    first = [0] if root_cause in (None, 0) else [0, root_cause]
    failed = [r for r in range(n) if states[r] is RankState.FAILED and r not in first]
    killed = [r for r in range(n) if states[r] is RankState.KILLED and r not in first][:2]
    return [*first, *failed, *killed][:LISTED_OF_MANY]


def _line(text: str) -> str:
    return text if len(text) <= RECORD_LINE_CHARS else text[:RECORD_LINE_CHARS] + " …"


def as_html(record: Record) -> str:
    """The record as self-contained HTML (no script, no style sheet): exports render it as is."""
    e = html.escape
    link = ""
    if record.link is not None and record.link.url:
        link = f' · <a href="{e(record.link.url)}" target="_blank">MLflow run</a>'
    elif record.link is not None:
        link = f" · {e(record.link.description)}"
    cpu = (
        "<div><i>CPU mode: no NVIDIA GPU is visible, so every rank ran on the CPU with gloo.</i></div>"
        if record.cpu_mode
        else ""
    )
    rows = "".join(
        f"<tr><td>rank {r.rank}</td><td>{e(r.state.value)}</td><td>{e(r.took)}</td>"
        f"<td>{e(r.reason)}</td></tr>"
        for r in record.rows
    )
    tails = "".join(
        f"<details{' open' if r.state is RankState.FAILED else ''}><summary>rank {r.rank}: last "
        f"{len(r.last_lines)} line(s)</summary><pre>{e(chr(10).join(_line(x) for x in r.last_lines))}</pre>"
        "</details>"
        for r in record.rows
    )
    logs = f"<div>logs: <code>{e(record.log_dir)}</code></div>" if record.log_dir else ""
    note = f"<div><i>{e(record.note)}</i></div>" if record.note else ""
    return (
        '<div class="air-magic-record">'
        f"<div><b>{e(record.name)}</b> · {record.world_size} rank(s) · {e(record.mode)} · "
        f"<b>{e(record.outcome)}</b> · {record.elapsed:.1f} s{link}</div>{note}{cpu}"
        f"{_many_html(record)}"
        "<table><tr><th align=left>rank</th><th align=left>state</th><th align=left>elapsed</th>"
        f"<th align=left>exit</th></tr>{rows}</table>{tails}{logs}</div>"
    )


def as_text(record: Record) -> str:
    """The record as plain text (a terminal frontend, a text export)."""
    ranks = f"{record.world_size} rank(s)"
    lines = [f"{record.name}: {record.outcome} in {record.elapsed:.1f} s, {ranks}, {record.mode}"]
    if record.note:
        lines.append(record.note)
    if record.cpu_mode:
        lines.append("CPU mode: no NVIDIA GPU is visible, so every rank ran on the CPU with gloo.")
    if len(record.rows) < record.world_size:
        lines.append(_many_text(record))
    for r in record.rows:
        took = f", {r.took}" if r.took else ""
        reason = f": {r.reason}" if r.reason else ""
        lines.append(f"  rank {r.rank} {r.state.value}{took}{reason}")
        lines += [f"    {_line(x)}" for x in r.last_lines]
    if record.log_dir:
        lines.append(f"logs: {record.log_dir}")
    if record.link is not None:
        lines.append(record.link.url or record.link.description)
    return "\n".join(lines)


def _many_text(record: Record) -> str:
    on = on_nodes(record.nodes)
    listed = ", ".join(str(r.rank) for r in record.rows)
    return f"ranks{on}: {record.counts}; listed here: {listed} (every rank's output is in its log)"


def _many_html(record: Record) -> str:
    if len(record.rows) >= record.world_size:
        return ""
    return f"<div>{html.escape(_many_text(record))}</div>"
