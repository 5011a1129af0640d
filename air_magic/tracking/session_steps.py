"""A persistent session's cells in its MLflow run: each cell's code, and one step per cell.

Called by ``calls/persistent.py`` on the caller's thread; every write is
queued on the tracked run's owner thread (``tracking/run.TrackedRun.jobs``), so
a cell never waits for the store.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from air_magic.protocol.events import Outcome


def log_cell_source(tracked: Any, number: int, kind: str, source: str | None) -> None:
    """The cell's code as ``cells/cell-NNNN.py`` (or ``.txt`` for what is not Python)."""
    if tracked is None or source is None:
        return
    suffix = "py" if kind in ("cell", "function") else "txt"
    tracked.jobs.put(
        functools.partial(
            tracked.client.log_text, tracked.run_id, source, f"cells/cell-{number:04d}.{suffix}"
        )
    )


def log_cell_step(tracked: Any, number: int, outcome: str, seconds: float) -> None:
    """One step per cell: how long it took and whether it succeeded."""
    if tracked is not None:
        tracked.jobs.put(
            functools.partial(_log_cell, tracked.client, tracked.run_id, number, outcome, seconds)
        )


def _log_cell(client: Any, run_id: str, number: int, outcome: str, seconds: float) -> None:
    """A cell's step in the session's run, in one write (on the MLflow run's owner thread)."""
    from mlflow.entities import Metric, RunTag

    now = int(time.time() * 1000)
    client.log_batch(
        run_id,
        metrics=[
            Metric("air_magic.cell_seconds", seconds, now, number),
            Metric("air_magic.cell_succeeded", float(outcome == Outcome.SUCCEEDED), now, number),
        ],
        tags=[RunTag("air_magic.cells", str(number))],
    )
