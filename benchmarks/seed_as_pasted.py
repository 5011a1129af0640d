"""The seed's example as a user pastes it: a fresh process, the first call, with and without its logging.

    python benchmarks/seed_as_pasted.py [--pairs 5] [--epochs 3] [--cpu]

Each run is a new ``python`` process running ``examples/seed_mlp.py`` as a
script (its ``__main__`` block: ``run_train.distributed(num_epochs=..., batch_size=1)``)
into a fresh embedded store, so it pays what a user's first call pays: the
warm starter, the store's creation, ``import mlflow`` in the caller and the
ranks. ``logged`` is the file as it is; ``unlogged`` is the same file with its
two ``mlflow.log_metric(...)`` calls made no-ops (the run is still recorded:
tracking on, parameters, logs). Pairs are interleaved, the order alternating;
the first pair warms the OS's file cache and is not counted.

Reports per variant the median process wall time, the median call time (what
the example's call took, from its own "succeeded in" line), the ratio
logged/unlogged per pair with its median and a bootstrap 90 % interval, and
the rows in each logged run's store (must be every step of every rank).
``--trace`` adds time stamps to the copies (the process's start, the rank's,
after ``setup()``, after training, around the call) and prints each run's
phases. ``--cpu`` runs the example on CPU ranks (gloo; ``torch.cuda.set_device`` and
``cuda:`` devices swapped out in the copy), for machines without GPUs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EXAMPLE = os.path.join(ROOT, "examples", "seed_mlp.py")


_MARK = "@@ {label} {{__import__('time').time()}}"


def _mark(label: str, indent: str) -> str:
    return f'{indent}print(f"{_MARK.format(label=label)}", flush=True)\n'


def _variant_source(logged: bool, epochs: int, cpu: bool, trace: bool = False) -> str:
    with open(EXAMPLE) as f:
        source = f.read()
    source = source.replace("num_epochs=3", f"num_epochs={epochs}")
    if trace:  # time stamps: where the process's seconds go (the call's phases, before and after it)
        source = _mark("process", "") + source
        source = source.replace(
            ") -> None:\n    import mlflow\n", ") -> None:\n" + _mark("rank", "    ") + "    import mlflow\n"
        )
        source = source.replace("    setup()\n", "    setup()\n" + _mark("setup", "    "))
        source = source.replace("    cleanup()\n\n", _mark("trained", "    ") + "    cleanup()\n\n")
        source = source.replace(
            "    run_train.distributed(",
            _mark("call", "    ") + "    try:\n        run_train.distributed(",
        )
        source = source.rstrip("\n") + "\n    finally:\n" + _mark("returned", "        ")
    if trace and logged:  # and the time each log_metric call takes in the rank
        source = source.replace(
            "    import mlflow\n",
            "    import mlflow\n"
            "    _log, _spent = mlflow.log_metric, []\n"
            "    def _timed(*args, **kwargs):\n"
            "        began = __import__('time').perf_counter()\n"
            "        try:\n"
            "            return _log(*args, **kwargs)\n"
            "        finally:\n"
            "            _spent.append(__import__('time').perf_counter() - began)\n"
            "    mlflow.log_metric = _timed\n",
            1,
        )
        source = source.replace(
            "    cleanup()\n\n",
            "    print(f'@@logging total={sum(_spent):.3f}s calls={len(_spent)} first={_spent[0]:.3f}s '\n"
            "          f'over_1ms={sum(t > 1e-3 for t in _spent)} max={max(_spent):.4f}s', flush=True)\n"
            "    cleanup()\n\n",
        )
    if not logged:
        source = source.replace("mlflow.log_metric(", "(lambda *args, **kwargs: None)(")
    if cpu:
        source = source.replace('torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))', "pass")
        source = source.replace('dist.init_process_group("nccl")', 'dist.init_process_group("gloo")')
        source = source.replace("f\"cuda:{int(os.environ['LOCAL_RANK'])}\"", '"cpu"')
        source = source.replace("model = DDP(model, device_ids=[device])", "model = DDP(model)")
    return source


def _one_run(path: str, store_dir: str) -> tuple[float, float, str]:
    env = dict(os.environ, AIR_MAGIC_MLFLOW_DIR=store_dir, MLFLOW_DISABLE_TELEMETRY="true")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    began = time.time()
    done = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    ended = time.time()
    marks = dict(re.findall(r"@@ (\w+) ([0-9.]+)", done.stdout + done.stderr))
    for line in re.findall(r"@@logging .*", done.stdout + done.stderr):
        print("  " + line[2:], flush=True)
    if marks:  # --trace: the seconds between consecutive marks, from the launch to the exit
        stamps = [("launch", began)] + [(k, float(v)) for k, v in marks.items()] + [("exit", ended)]
        print(
            "  phases: "
            + ", ".join(f"{a}->{b} {tb - ta:.2f}" for (a, ta), (b, tb) in itertools.pairwise(stamps)),
            flush=True,
        )
    if done.returncode != 0:
        raise SystemExit(f"{path} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    found = re.search(r"succeeded in ([0-9.]+) s", done.stdout + done.stderr)
    return wall, float(found.group(1)) if found else float("nan"), done.stdout + done.stderr


def _rows(store_dir: str) -> int:
    from mlflow.tracking import MlflowClient

    from air_magic import paths

    os.environ["AIR_MAGIC_MLFLOW_DIR"] = store_dir
    client = MlflowClient(paths.embedded_mlflow_uri())
    total = 0
    for experiment in client.search_experiments():
        for run in client.search_runs([experiment.experiment_id]):
            total += len(client.get_metric_history(run.info.run_id, "loss"))
    return total


def _interval(pairs: list[tuple[float, float]], rounds: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    medians = sorted(
        statistics.median(a / b for a, b in (rng.choice(pairs) for _ in pairs)) for _ in range(rounds)
    )
    return medians[int(0.05 * rounds)], medians[int(0.95 * rounds) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--trace", action="store_true", help="print where each run's seconds go")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="air_magic-seed-pasted-")
    paths = {}
    for name, logged in (("logged", True), ("unlogged", False)):
        paths[name] = os.path.join(work, f"seed_{name}.py")
        with open(paths[name], "w") as f:
            f.write(_variant_source(logged, args.epochs, args.cpu, args.trace))
    walls: dict[str, list[float]] = {"logged": [], "unlogged": []}
    calls: dict[str, list[float]] = {"logged": [], "unlogged": []}
    rows = []
    for pair in range(args.pairs + 1):
        order = ("logged", "unlogged") if pair % 2 == 0 else ("unlogged", "logged")
        for name in order:
            store = tempfile.mkdtemp(prefix=f"store-{name}-", dir=work)
            wall, call, _ = _one_run(paths[name], store)
            print(f"pair {pair} {name}: process {wall:.2f} s, call {call:.2f} s", flush=True)
            if pair == 0:
                continue  # warms the file cache
            walls[name].append(wall)
            calls[name].append(call)
            if name == "logged":
                rows.append(_rows(store))
    pairs = list(zip(walls["logged"], walls["unlogged"], strict=True))
    low, high = _interval(pairs)
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d %H:%M"),
                "command": "python benchmarks/seed_as_pasted.py "
                + f"--pairs {args.pairs} --epochs {args.epochs}"
                + (" --cpu" if args.cpu else "")
                + (" --trace" if args.trace else ""),
                "cores": os.cpu_count(),
                "process_s": {k: [round(t, 2) for t in v] for k, v in walls.items()},
                "call_s": {k: [round(t, 2) for t in v] for k, v in calls.items()},
                "median_process_s": {k: round(statistics.median(v), 2) for k, v in walls.items()},
                "median_call_s": {k: round(statistics.median(v), 2) for k, v in calls.items()},
                "ratio_logged_unlogged_median": round(statistics.median(a / b for a, b in pairs), 3),
                "ratio_90_interval": [round(low, 3), round(high, 3)],
                "loss_rows_per_logged_run": rows,
                "loss_rows_expected": 5000 * args.epochs,  # batch_size 1: a row per sample per epoch
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
