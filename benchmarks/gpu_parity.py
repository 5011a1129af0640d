"""Each example under air_magic and under torchrun, same seeds: losses side by side, and speed.

    python benchmarks/gpu_parity.py [--examples seed ddp fsdp2 zero2 zero3] [--json OUT]

For every example, the same wrapper (:func:`run_seeded`) runs on every rank under
both launchers: it seeds Python, NumPy and torch, turns on cuDNN's deterministic
kernels, imports the example's module from ``examples/`` and calls the plain
function (``fn.func``) with the same arguments, timing it inside the rank. Under
air_magic the wrapper goes through ``.distributed()`` (warm start, tracking on);
under torchrun it is this file with ``--rank-entry``. Losses are compared rank by
rank: the example's returned losses, or for the seed's example the per-epoch
totals it prints. ``seconds`` is rank 0's time inside the function (process group,
data, training); ``wall`` is the whole launch as a user waits for it.

Needs GPUs for the seed's and DeepSpeed's examples; without one, ``--small`` runs
the DDP and FSDP2 examples, shrunk, on 2 CPU ranks (a check of this script, not a
measurement). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")
TOLERANCE = 1e-4  # relative, per loss value

# name -> (module, function, arguments, what a run processes: (count, unit))
CASES: dict[str, tuple[str, str, dict[str, Any], tuple[int, str]]] = {
    # The seed's code unchanged; batch_size 32 instead of 1 keeps the torchrun side
    # (MLflow's direct path, 4.5 ms per log_metric) from dominating: 3 x 5000 samples.
    "seed": ("seed_mlp", "run_train", {"num_epochs": 3, "batch_size": 32}, (15_000, "samples")),
    "ddp": ("ddp_progress", "train_cnn", {"epochs": 3}, (60_000, "samples")),
    "fsdp2": ("fsdp2_transformer", "train_lm", {"steps": 200}, (0, "tokens")),
    "zero2": ("deepspeed_zero", "train_zero", {"stage": 2}, (0, "samples")),
    "zero3": ("deepspeed_zero", "train_zero", {"stage": 3}, (0, "samples")),
}


SMALL = {
    "ddp": {"epochs": 2, "samples": 2000},
    "fsdp2": {"steps": 20, "batch_size": 8, "seq_len": 32, "layers": 2},
}


class _Tee(io.TextIOBase):
    def __init__(self, out: Any):
        self.out, self.buffer_ = out, io.StringIO()

    def write(self, text: str) -> int:
        self.buffer_.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


def run_seeded(module: str, function: str, kwargs: dict[str, Any], seed: int) -> dict[str, Any]:
    """On every rank, under either launcher: seed, call the example, time it, keep what it printed."""
    import importlib
    import random

    import numpy as np
    import torch

    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    fn = getattr(importlib.import_module(module), function)
    fn = getattr(fn, "func", fn)  # the plain function under the @distributed wrapper
    tee = _Tee(sys.stdout)
    start = time.perf_counter()
    with contextlib.redirect_stdout(tee):
        result = fn(**kwargs)
    seconds = time.perf_counter() - start
    return {"result": result, "stdout": tee.buffer_.getvalue(), "seconds": seconds}


def losses_of(outcome: dict[str, Any]) -> list[float]:
    result = outcome["result"]
    if isinstance(result, dict):
        return list(result.get("losses") or result.get("epoch_losses") or [])
    return [float(x) for x in re.findall(r"Total loss for epoch \d+: ([-\d.eE+]+)", outcome["stdout"])]


def under_air_magic(name: str, seed: int, kwargs: dict[str, Any]) -> tuple[list[dict[str, Any]], float]:
    from air_magic import distributed

    module, function, _, _ = CASES[name]
    start = time.perf_counter()
    outcomes = distributed(display="text")(run_seeded).distributed(module, function, kwargs, seed)
    return outcomes, time.perf_counter() - start


def under_torchrun(
    name: str, seed: int, kwargs: dict[str, Any], ranks: int
) -> tuple[list[dict[str, Any]], float]:
    module, function, _, _ = CASES[name]
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ)
        env.update(_mlflow_run_for_torchrun(out))
        start = time.perf_counter()
        subprocess.run(
            [
                sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                __file__, "--rank-entry", json.dumps([module, function, kwargs, seed, out]),
            ],
            check=True, env=env,
        )  # fmt: skip
        wall = time.perf_counter() - start
        outcomes = []
        for rank in range(ranks):
            with open(os.path.join(out, f"rank-{rank}.json")) as f:
                outcomes.append(json.load(f))
    return outcomes, wall


def _mlflow_run_for_torchrun(folder: str) -> dict[str, str]:
    """The seed's example logs to MLflow: give torchrun's ranks one run, as a user would."""
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        return {}
    uri = f"sqlite:///{folder}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("torchrun", artifact_location=f"file://{folder}/artifacts")
    run = client.create_run(experiment)
    return {"MLFLOW_TRACKING_URI": uri, "MLFLOW_RUN_ID": run.info.run_id, "MLFLOW_EXPERIMENT_ID": experiment}


def _rank_entry(spec: str) -> None:
    module, function, kwargs, seed, out = json.loads(spec)
    outcome = run_seeded(module, function, kwargs, seed)
    with open(os.path.join(out, f"rank-{os.environ['RANK']}.json"), "w") as f:
        json.dump(outcome, f)


def _units(name: str, outcome: dict[str, Any]) -> tuple[int, str]:
    count, unit = CASES[name][3]
    result = outcome["result"]
    if isinstance(result, dict) and unit in result:
        count = int(result[unit])
    return count, unit


def compare(name: str, ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> dict[str, Any]:
    worst = 0.0
    for a, b in zip(ours, theirs, strict=True):
        la, lb = losses_of(a), losses_of(b)
        if len(la) != len(lb) or not la:
            return {"match": False, "why": f"loss lists differ in length: {len(la)} vs {len(lb)}"}
        for x, y in zip(la, lb, strict=True):
            worst = max(worst, abs(x - y) / max(abs(y), 1e-12))
    count, unit = _units(name, ours[0])
    return {
        "match": worst <= TOLERANCE,
        "max_rel_diff": worst,
        "air_magic_losses": losses_of(ours[0]),
        "torchrun_losses": losses_of(theirs[0]),
        "air_magic_s": ours[0]["seconds"],
        "torchrun_s": theirs[0]["seconds"],
        "unit": unit,
        "air_magic_rate": count / ours[0]["seconds"] if count else None,
        "torchrun_rate": count / theirs[0]["seconds"] if count else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--examples", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every number here too")
    parser.add_argument("--small", action="store_true", help="shrunk DDP and FSDP2 runs (works on the CPU)")
    parser.add_argument("--rank-entry", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_entry:
        _rank_entry(args.rank_entry)
        return
    from air_magic.launch.accelerators import detect_gpus

    ranks = len(detect_gpus())
    if not ranks and not args.small:
        sys.exit("gpu_parity needs NVIDIA GPUs (the seed's and DeepSpeed's examples use CUDA); try --small")
    names = [n for n in args.examples if n in SMALL] if args.small else args.examples
    ranks = ranks or 2
    rows = {}
    for name in names:
        kwargs = {**CASES[name][2], **(SMALL[name] if args.small else {})}
        ours, our_wall = under_air_magic(name, args.seed, kwargs)
        theirs, their_wall = under_torchrun(name, args.seed, kwargs, ranks)
        row = compare(name, ours, theirs)
        row.update({"air_magic_wall_s": our_wall, "torchrun_wall_s": their_wall, "ranks": ranks})
        rows[name] = row
        print(f"{name}: {json.dumps(row)}", flush=True)
    print()
    print(
        "| example | ranks | losses match (rel. tol. 1e-4) | max rel. diff | final loss air_magic / torchrun "
        "| in-function s air_magic / torchrun | rate air_magic / torchrun | wall s air_magic / torchrun |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        if "max_rel_diff" not in r:
            print(f"| {name} | {r['ranks']} | no: {r['why']} | | | | | |")
            continue
        rate = (
            f"{r['air_magic_rate']:,.0f} / {r['torchrun_rate']:,.0f} {r['unit']}/s"
            if r["air_magic_rate"]
            else "n/a"
        )
        print(
            f"| {name} | {r['ranks']} | {'yes' if r['match'] else 'NO'} | {r['max_rel_diff']:.1e} "
            f"| {r['air_magic_losses'][-1]:.5f} / {r['torchrun_losses'][-1]:.5f} "
            f"| {r['air_magic_s']:.2f} / {r['torchrun_s']:.2f} | {rate} "
            f"| {r['air_magic_wall_s']:.1f} / {r['torchrun_wall_s']:.1f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
