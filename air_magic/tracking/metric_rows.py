"""In the caller: how the metric writer's rows reach the store (its one ``write``).

:class:`~air_magic.tracking.metric_writer.MetricWriter` reads the ranks' metric
lines and hands rows ``(key, value, timestamp, step)`` to the sink
:func:`sink_for` picks for the call's store:

- :class:`SqliteRows`, for a sqlite store (the embedded one, or the user's): the
  rows go into MLflow's own ``metrics`` and ``latest_metrics`` tables in one
  transaction, through the store's own SQLAlchemy engine, as two ``executemany``
  statements: MLflow's ``log_batch`` spends ~100 µs a row building ORM objects
  (about 10,000 rows/s here), this ~6 µs (150,000 rows/s, parsing included;
  docs/benchmarks.md "Metric rows"). What MLflow's ``log_batch`` does with a row,
  it does too: NaN stored as 0 with ``is_nan``, ±inf as the largest float, a row
  identical to one stored ignored (the table's primary key), ``latest_metrics``
  moved only to a row later by (step, timestamp, value). The table and column
  names are MLflow's, read from its models, and ``tests/process/test_mlflow_private_api.py``
  checks the result against ``log_batch``'s on the same rows.
- :class:`LogBatch`, for any other store (an HTTP server, a database server):
  MLflow's ``log_batch``, 1,000 rows a request (MLflow's limit).

A sink's ``write`` raises when the store refuses; the writer keeps the rows and
retries them on its next pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

Row = tuple[str, float, int, int]  # key, value, timestamp (ms), step

_LARGEST = 1.7976931348623157e308  # what MLflow stores for ±inf (SQL has no infinity)


class Sink(Protocol):
    batch: int  # rows per write

    def write(self, rows: Sequence[Row]) -> None: ...


class LogBatch:
    """MLflow's ``log_batch``: any store."""

    batch = 1000  # MLflow's limit of metrics in one log_batch request

    def __init__(self, client: Any, run_id: str):
        self.client = client
        self.run_id = run_id

    def write(self, rows: Sequence[Row]) -> None:
        from mlflow.entities import Metric

        self.client.log_batch(self.run_id, metrics=[Metric(k, v, t, s) for k, v, t, s in rows])


class SqliteRows:
    """Rows straight into MLflow's tables of a sqlite store, one transaction a write."""

    batch = 50_000  # a transaction of this many rows takes about 0.3 s here

    def __init__(self, engine: Any, run_id: str):
        from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric

        self.engine = engine
        self.run_id = run_id
        metrics, latest = SqlMetric.__table__.name, SqlLatestMetric.__table__.name
        columns = "key, value, timestamp, step, is_nan, run_uuid"
        self._insert = f"INSERT OR IGNORE INTO {metrics} ({columns}) VALUES (?, ?, ?, ?, ?, ?)"
        # SQLite compares row values in order: (step, timestamp, value), as MLflow's store does.
        self._latest = (
            f"INSERT INTO {latest} ({columns}) VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (key, run_uuid) DO UPDATE SET value = excluded.value, "
            "timestamp = excluded.timestamp, step = excluded.step, is_nan = excluded.is_nan "
            f"WHERE (excluded.step, excluded.timestamp, excluded.value) > "
            f"({latest}.step, {latest}.timestamp, {latest}.value)"
        )

    def write(self, rows: Sequence[Row]) -> None:
        stored = []
        latest: dict[str, tuple[Any, ...]] = {}
        run_id = self.run_id
        for key, value, timestamp, step in rows:
            is_nan = value != value
            if is_nan:
                value = 0.0
            elif math.isinf(value):
                value = _LARGEST if value > 0 else -_LARGEST
            row = (key, value, timestamp, step, is_nan, run_id)
            stored.append(row)
            now = latest.get(key)
            if now is None or (step, timestamp, value) > (now[3], now[2], now[1]):
                latest[key] = row
        with self.engine.begin() as connection:
            connection.exec_driver_sql(self._insert, stored)
            connection.exec_driver_sql(self._latest, list(latest.values()))


# SQLAlchemy's first line when a query's autoflush failed: the cause is on the next line.
_PREAMBLE = "(raised as a result of"


def short_error(exc: BaseException, limit: int = 300) -> str:
    """A store's error in one line: without the SQL, the parameters and the traceback SQLAlchemy
    and MLflow append, or a whole HTML page a proxy answered."""
    lines = [line.strip() for line in str(exc).strip().splitlines()]
    text = next((line for line in lines if line and not line.startswith(_PREAMBLE)), "")
    return f"{type(exc).__name__}: {text[:limit]}"


def sink_for(client: Any, run_id: str) -> Sink:
    """:class:`SqliteRows` when the client's store is a sqlite one of MLflow's, else :class:`LogBatch`."""
    try:
        store = client._tracking_client.store
        engine = store.engine
        if engine.dialect.name == "sqlite":
            return SqliteRows(engine, run_id)
    except Exception:  # noqa: BLE001 - another store, or another MLflow: its public API
        pass
    return LogBatch(client, run_id)
