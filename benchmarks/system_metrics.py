"""What system metrics cost a call: the same training call with ``system_metrics`` on and off.

    python benchmarks/system_metrics.py [--pairs 6] [--example seed_mlp|quickstart] [--epochs 1]

One process, tracked calls into a fresh embedded store, interleaved on/off then
off/on (never always one first), after one warm-up call of each. ``seed_mlp`` is the
hosted product's example as it is (GPUs only: it calls ``torch.cuda.set_device``);
``quickstart`` runs anywhere. Prints each pair's wall times, the ratio on/off per
pair, its median and range, and which ``system/`` keys the last "on" run holds.
``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` (MLflow's, 10 s by default) sets the
sampling pace; a smaller one is the harder case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--example", choices=["seed_mlp", "quickstart"], default="seed_mlp")
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("AIR_MAGIC_MLFLOW_DIR", tempfile.mkdtemp(prefix="air_magic-bench-mlflow-"))
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    from mlflow.tracking import MlflowClient

    import air_magic
    from air_magic import paths

    if args.example == "seed_mlp":
        from seed_mlp import run_train

        fn, call_args = run_train.with_overrides(display="none"), {"num_epochs": args.epochs, "batch_size": 1}
    else:
        from quickstart import train

        fn, call_args = train.with_overrides(display="none"), {"epochs": args.epochs}
    variants = {"on": fn.with_overrides(system_metrics=True), "off": fn.with_overrides(system_metrics=False)}
    for variant in variants.values():  # warm-up: the warm starter, the store, imports
        variant.distributed(**call_args)
    times: dict[str, list[float]] = {"on": [], "off": []}
    last_on = None
    for pair in range(args.pairs):
        order = ("on", "off") if pair % 2 == 0 else ("off", "on")
        for name in order:
            began = time.perf_counter()
            variants[name].distributed(**call_args)
            times[name].append(time.perf_counter() - began)
            if name == "on":
                last_on = air_magic.last_run()
    ratios = [on / off for on, off in zip(times["on"], times["off"], strict=True)]
    client = MlflowClient(paths.embedded_mlflow_uri())
    run = client.get_run(last_on.mlflow_run_id) if last_on and last_on.mlflow_run_id else None
    keys = sorted(k for k in run.data.metrics if k.startswith("system/")) if run else []
    print(
        json.dumps(
            {
                "example": args.example,
                "epochs": args.epochs,
                "pairs": args.pairs,
                "sampling_interval_s": os.environ.get(
                    "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "10 (MLflow's)"
                ),
                "on_s": [round(t, 2) for t in times["on"]],
                "off_s": [round(t, 2) for t in times["off"]],
                "median_on_s": round(statistics.median(times["on"]), 2),
                "median_off_s": round(statistics.median(times["off"]), 2),
                "ratio_on_off_median": round(statistics.median(ratios), 3),
                "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
                "system_keys": keys,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
