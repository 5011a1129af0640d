"""The caller's metric writer: rows per second into the embedded (sqlite) store, by sink.

    python benchmarks/metric_rows.py [--ranks 64] [--rows 2000] [--rounds 5]

Each round writes ``--ranks`` files of ``--rows`` metric lines each (the lines ranks append,
worker/metrics.py), then times one :class:`MetricWriter` pass over them into a fresh store,
once per sink, the order alternating between rounds: ``sqlite-rows`` (air_magic's path for a
sqlite store, tracking/metric_rows.py) and ``log-batch`` (MLflow's ``log_batch``, 1,000 rows a
request: the path before, and still the one for other stores). Reports wall and CPU seconds of
the pass and rows/s (median, min, max over rounds), and checks every row is in the store.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def one_pass(sink_name: str, ranks: int, rows: int, folder: str) -> dict[str, float]:
    from mlflow.tracking import MlflowClient

    from air_magic.tracking import metric_rows
    from air_magic.tracking.metric_writer import MetricWriter

    store = os.path.join(folder, f"{sink_name}.db")
    client = MlflowClient(f"sqlite:///{store}")
    experiment = client.create_experiment("rows", artifact_location=f"file://{folder}/artifacts")
    run_id = client.create_run(experiment).info.run_id
    lines = os.path.join(folder, f"lines-{sink_name}")
    os.makedirs(lines)
    t = 1_700_000_000_000
    for rank in range(ranks):
        with open(os.path.join(lines, f"rank-{rank}.tsv"), "w") as f:
            f.writelines(f"rank{rank}_loss\t{1.0 / (s + 1)}\t{t + s}\t{s}\n" for s in range(rows))
    sink = (
        metric_rows.SqliteRows(client._tracking_client.store.engine, run_id)
        if sink_name == "sqlite-rows"
        else metric_rows.LogBatch(client, run_id)
    )
    writer = MetricWriter(client, run_id, lines, sink=sink)
    wall, cpu = time.perf_counter(), time.process_time()
    assert writer.write_pass()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    with client._tracking_client.store.engine.connect() as connection:
        count = "SELECT COUNT(*) FROM metrics WHERE run_uuid = ?"
        stored = connection.exec_driver_sql(count, (run_id,)).scalar()
    assert stored == ranks * rows, (stored, ranks * rows)
    return {"wall_s": wall, "cpu_s": cpu, "rows_per_s": ranks * rows / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import logging

    logging.getLogger("mlflow").setLevel(logging.WARNING)  # MLflow's "creating tables" lines
    results: dict[str, list[dict[str, float]]] = {"sqlite-rows": [], "log-batch": []}
    for round_ in range(args.rounds):
        order = ["sqlite-rows", "log-batch"] if round_ % 2 == 0 else ["log-batch", "sqlite-rows"]
        with tempfile.TemporaryDirectory() as folder:
            for name in order:
                results[name].append(one_pass(name, args.ranks, args.rows, folder))
    summary = {}
    for name, runs in results.items():
        rates = [r["rows_per_s"] for r in runs]
        summary[name] = {
            "rows_per_s_median": statistics.median(rates),
            "rows_per_s_min": min(rates),
            "rows_per_s_max": max(rates),
            "cpu_s_median": statistics.median(r["cpu_s"] for r in runs),
            "wall_s_median": statistics.median(r["wall_s"] for r in runs),
        }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    total = args.ranks * args.rows
    print(f"{args.ranks} ranks x {args.rows} rows = {total} rows a pass, {args.rounds} rounds")
    for name, s in summary.items():
        print(
            f"{name:12s} {s['rows_per_s_median']:9.0f} rows/s (min {s['rows_per_s_min']:.0f}, "
            f"max {s['rows_per_s_max']:.0f}); pass {s['wall_s_median']:.2f} s wall, "
            f"{s['cpu_s_median']:.2f} s CPU"
        )


if __name__ == "__main__":
    main()
