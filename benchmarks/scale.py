"""What the caller pays as the rank count grows (issue 34): real CPU ranks, warm, one caller.

    python benchmarks/scale.py [--ranks 8 32 64 128 256] [--lines 200] [--metrics 200] [--display none]

Each call's ranks join gloo, all-reduce once, print ``--lines`` lines and log ``--metrics``
values with ``mlflow.log_metric`` into the embedded store (a fresh one in a temp folder), as the
issue measured. Per rank count: the call's wall time, the caller's own CPU (this process, all its
threads: the output router, the metric writer, the display; not the ranks, not the warm starter)
and peak RSS, the open-file limit it ran under, and the rows found in the store (all must be
there). Set ``AIR_MAGIC_FORCE_CPU=1`` on a GPU machine to run CPU ranks.

``--synthetic``: past what the machine can run, synthetic ranks through the real caller
(``benchmarks/synthetic_ranks.py``): each rank prints ``--rate`` lines and logs ``--rate``
metrics a second, redraws a bar twice a second, one rank at a time bursts 2,000 lines every 5 s,
for ``--seconds``; the widget view's messages counted. One JSON row per rank count.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rank_work(lines: int, metrics: int) -> int:
    import os

    import mlflow
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.ones(1)
    dist.all_reduce(value)
    rank = os.environ["RANK"]
    for i in range(lines):
        print(f"rank {rank} step {i} loss {1.0 / (i + 1):.4f}")
    for i in range(metrics):
        mlflow.log_metric(f"loss_rank{rank}", 1.0 / (i + 1), step=i)  # a key each: none deduplicated
    dist.destroy_process_group()
    return int(value.item())


def measure(ranks: int, lines: int, metrics: int, display: str) -> dict[str, float]:
    from mlflow.tracking import MlflowClient

    import air_magic
    from air_magic import distributed, paths

    call = distributed(num_accelerators=ranks, display=display, experiment=f"scale-{ranks}")(rank_work)
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    values = call.distributed(lines, metrics)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    assert values == [ranks] * ranks, values[:4]
    run_id = air_magic.last_run().mlflow_run_id
    engine = MlflowClient(paths.embedded_mlflow_uri())._tracking_client.store.engine
    with engine.connect() as connection:
        # The ranks' rows only: a long call also samples system metrics into the run.
        count = "SELECT COUNT(*) FROM metrics WHERE run_uuid = ? AND key LIKE 'loss_rank%'"
        rows = connection.exec_driver_sql(count, (run_id,)).scalar()
    return {
        "ranks": ranks,
        "wall_s": round(wall, 2),
        "caller_cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2),
        "caller_maxrss_mb": round(after.ru_maxrss / 1024, 1),
        "rows": rows,
        "rows_expected": ranks * metrics,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32, 64, 128, 256])
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--metrics", type=int, default=200)
    parser.add_argument("--display", default=None, help="none for real ranks, tabs for --synthetic")
    parser.add_argument("--synthetic", action="store_true", help="synthetic ranks (see above)")
    parser.add_argument("--rate", type=float, default=10.0, help="--synthetic: lines and metrics a second")
    parser.add_argument("--seconds", type=float, default=20.0, help="--synthetic: how long each call")
    args = parser.parse_args()
    if args.synthetic:
        _synthetic(args)
        return
    folder = tempfile.mkdtemp(prefix="scale-")
    os.environ.setdefault("AIR_MAGIC_MLFLOW_DIR", os.path.join(folder, "mlflow"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    print(json.dumps({"cpus": os.cpu_count(), "nofile_soft": soft, "nofile_hard": hard}), flush=True)
    measure(2, 1, 1, "none")  # the warm starter and MLflow up: not part of any row
    for ranks in args.ranks:
        try:
            print(json.dumps(measure(ranks, args.lines, args.metrics, args.display or "none")), flush=True)
        except Exception as exc:  # noqa: BLE001 - the next count still runs; the failure is the row
            error = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(json.dumps({"ranks": ranks, "error": error}), flush=True)


def _synthetic(args: argparse.Namespace) -> None:
    """Each rank count in a process of its own: one call's widgets and store, nothing carried over."""
    import subprocess

    harness = os.path.join(os.path.dirname(os.path.abspath(__file__)), "synthetic_ranks.py")
    print(json.dumps({"cpus": os.cpu_count(), "mode": "synthetic", "rate": args.rate}), flush=True)
    display = args.display or "tabs"
    for ranks in args.ranks:
        rate = str(args.rate)
        command = [sys.executable, harness, "--ranks", str(ranks), "--seconds", str(args.seconds)]
        command += ["--lines-per-s", rate, "--metrics-per-s", rate, "--display", display]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        lines = done.stdout.strip().splitlines()
        print(lines[-1] if lines else json.dumps({"ranks": ranks, "error": done.stderr[-300:]}), flush=True)


if __name__ == "__main__":
    main()
