"""What per-step ``mlflow.log_metric`` costs a training run, by path, in the same process.

    python benchmarks/metrics_logging.py flood [--ranks 8] [--metrics 5000] [--modes ...]
    python benchmarks/metrics_logging.py seed  [--modes off batched direct]   # needs GPUs
    python benchmarks/metrics_logging.py latency [--metrics 20]

Modes:

- ``batched``: air_magic's path (ranks append to a file; the caller writes batches).
- ``direct``: ``AIR_MAGIC_METRICS=direct``, MLflow's own path (one insert per call).
- ``rank-batch``: the alternative design, measured to choose between them: each rank
  buffers its metrics and a thread in the rank writes them with ``log_batch`` every
  0.5 s (flood only; the benchmark's own code, not a mode of air_magic).
- ``off``: the same function with ``mlflow.log_metric`` replaced by a no-op (seed only).

``latency``: rank 0 logs one metric, then reads the store until it is there, ``--metrics``
times in a row while rank 1 trains nothing; reports the median and worst seconds from
``log_metric`` to visible in the store (the batched path; MLflow's direct path is
visible on return).

``flood``: every rank logs ``--metrics`` values as fast as it can into one fresh
sqlite store (one store, a new run per mode); reports the call's wall time, the
slowest rank's logging loop, and the rows found in the store afterwards (all must
be there). ``seed``: the seed's
example as written (``examples/seed_mlp.py``: 3 epochs, batch_size 1, a
``log_metric`` per step per rank) on every GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")


def flood(count: int, mode: str) -> float:
    """In a rank: log ``count`` metrics; return the seconds the logging loop took."""
    import os
    import threading
    import time

    import mlflow

    rank = int(os.environ["RANK"])
    key = f"rank{rank}"
    run_id = os.environ["MLFLOW_RUN_ID"]  # (MLflow's start_run, which log_metric calls, removes it)
    mlflow.log_metric("warm-up", 1.0)  # connects to the store: not part of the per-metric cost
    start = time.perf_counter()
    if mode != "rank-batch":
        for i in range(count):
            mlflow.log_metric(key, float(i), step=i)
        return time.perf_counter() - start
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    buffer: list[Any] = []
    lock, stop = threading.Lock(), threading.Event()

    def drain() -> None:
        while True:
            with lock:
                batch, buffer[:] = buffer[:1000], buffer[1000:]
            if not batch:
                return
            client.log_batch(run_id, metrics=batch)

    def loop() -> None:
        while not stop.wait(0.5):
            drain()

    flusher = threading.Thread(target=loop, daemon=True)
    flusher.start()
    for i in range(count):
        with lock:
            buffer.append(Metric(key, float(i), int(time.time() * 1000), i))
    stop.set()
    flusher.join()
    drain()
    return time.perf_counter() - start


def visible_after(count: int) -> list[float]:
    """In a rank: seconds from ``log_metric`` until ``MlflowClient`` reads the value back."""
    import os
    import time

    import mlflow
    from mlflow.tracking import MlflowClient

    if os.environ["RANK"] != "0":
        return []
    run_id = os.environ["MLFLOW_RUN_ID"]
    client = MlflowClient()
    took = []
    for i in range(count):
        start = time.perf_counter()
        mlflow.log_metric("probe", float(i), step=i)
        while len(client.get_metric_history(run_id, "probe")) <= i:
            time.sleep(0.01)
        took.append(time.perf_counter() - start)
    return took


def seed_example(mode: str) -> float:
    """In a rank: the seed's ``run_train`` as written; ``off`` makes ``log_metric`` a no-op."""
    import sys
    import time

    import mlflow

    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import seed_mlp

    if mode == "off":
        mlflow.log_metric = lambda *args, **kwargs: None
    start = time.perf_counter()
    seed_mlp.run_train.func(num_epochs=3, batch_size=1)
    return time.perf_counter() - start


def run_mode(case: str, mode: str, ranks: int | None, count: int) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    from air_magic import distributed, last_run

    if mode in ("direct", "rank-batch"):
        os.environ["AIR_MAGIC_METRICS"] = "direct"
    else:
        os.environ.pop("AIR_MAGIC_METRICS", None)
    fn = distributed(num_accelerators=ranks, display="none")(flood if case == "flood" else seed_example)
    start = time.perf_counter()
    inside = fn.distributed(count, mode) if case == "flood" else fn.distributed(mode)
    wall = time.perf_counter() - start
    info = last_run()
    assert info is not None and info.mlflow_run_id
    from air_magic import paths

    client = MlflowClient(paths.embedded_mlflow_uri())
    world = len(inside)
    if case == "flood":
        rows = sum(len(client.get_metric_history(info.mlflow_run_id, f"rank{r}")) for r in range(world))
        expected = world * count
    else:
        rows = len(client.get_metric_history(info.mlflow_run_id, "loss"))
        expected = 0 if mode == "off" else 3 * -(-5000 // world) * world
    return {
        "mode": mode,
        "ranks": world,
        "wall_s": round(wall, 2),
        "slowest_rank_s": round(max(inside), 2),
        "rows": rows,
        "expected_rows": expected,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("case", choices=["flood", "seed", "latency"])
    parser.add_argument("--ranks", type=int, default=None, help="flood: default 8; seed: every GPU")
    parser.add_argument("--metrics", type=int, default=5000, help="flood: metrics per rank")
    parser.add_argument("--modes", nargs="+", default=None)
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    if args.case == "latency":
        from air_magic import distributed

        os.environ["AIR_MAGIC_MLFLOW_DIR"] = tempfile.mkdtemp(prefix="metrics-bench-")
        took = sorted(
            distributed(num_accelerators=2, display="none")(visible_after).distributed(args.metrics)[0]
        )
        median = took[len(took) // 2]
        print(f"log_metric -> visible in the store, {len(took)} samples: median {median:.2f} s, "
              f"best {took[0]:.2f} s, worst {took[-1]:.2f} s")  # fmt: skip
        return
    if args.case == "flood":
        modes = args.modes or ["batched", "rank-batch", "direct"]
        ranks = args.ranks or 8
    else:
        modes = args.modes or ["off", "batched", "direct"]
        ranks = args.ranks
    from air_magic import distributed

    # One fresh store for every mode (a new run each), created by a warm-up call that also
    # starts the warm starter: neither is part of any mode's time.
    os.environ["AIR_MAGIC_MLFLOW_DIR"] = tempfile.mkdtemp(prefix="metrics-bench-")
    distributed(num_accelerators=ranks, display="none")(time.time).distributed()
    rows = []
    for mode in modes:
        row = run_mode(args.case, mode, ranks, args.metrics)
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = next((r["wall_s"] for r in rows if r["mode"] in ("off", "batched")), None)
    print()
    measured = "logging loop" if args.case == "flood" else "training"
    print(
        f"| mode | ranks | call wall (s) | slowest rank's {measured} (s) "
        "| rows in store / expected | wall vs first row |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['wall_s'] / base:.2f}x" if base else ""
        print(
            f"| {r['mode']} | {r['ranks']} | {r['wall_s']} | {r['slowest_rank_s']} "
            f"| {r['rows']} / {r['expected_rows']} | {ratio} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    sys.exit(0 if all(r["rows"] == r["expected_rows"] for r in rows) else 1)


if __name__ == "__main__":
    main()
