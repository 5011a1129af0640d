"""The shared MLflow UI server: its processes, memory and CPU, MLflow's job runner off (ours) vs on.

    python benchmarks/ui_server.py [--pairs 3]

Each round starts the UI over a new, empty embedded store as ``air-magic ui`` does (the
keeper, ``mlflow server``, its web worker), waits until ``/health`` answers, lets it settle
5 s, then reads the keeper's whole process tree with psutil: the number of processes, their
summed RSS and their CPU time (the live processes' own; a start-up helper that already
exited is not counted), and stops it with ``air-magic ui --stop``. "on" sets
``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true`` (what MLflow does by default, and what the keeper
keeps when a user sets it); "off" is air_magic's default. Rounds alternate the order.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil

AIR_MAGIC = os.path.join(os.path.dirname(sys.executable), "air-magic")


def one(job_runner: bool) -> dict[str, float]:
    folder = tempfile.mkdtemp(prefix="air-magic-ui-bench-")
    env = dict(os.environ, AIR_MAGIC_MLFLOW_DIR=folder)
    if job_runner:
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "true"
    else:
        env.pop("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", None)
    start = time.perf_counter()
    out = subprocess.run([AIR_MAGIC, "ui"], env=env, capture_output=True, text=True, timeout=300)
    url = next(w for w in out.stdout.split() if w.startswith("http")).split("/#")[0]
    while True:
        try:
            urllib.request.urlopen(url.rstrip("/") + "/health", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    up_s = time.perf_counter() - start
    time.sleep(5)
    tree = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "air_magic.tracking.ui_server" in cmdline and folder in cmdline:
            tree += [proc, *proc.children(recursive=True)]
    tree = list({p.pid: p for p in tree}.values())  # a keeper's fork is its own child too
    result = {
        "up_s": up_s,
        "processes": len(tree),
        "rss_mb": sum(p.memory_info().rss for p in tree) / 2**20,
        "cpu_s": sum(sum(p.cpu_times()[:2]) for p in tree),
    }
    subprocess.run([AIR_MAGIC, "ui", "--stop"], env=env, capture_output=True, timeout=120)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for i in range(args.pairs):
        for side in ("off", "on") if i % 2 == 0 else ("on", "off"):
            rows[side].append(one(side == "on"))
            print(side, json.dumps({k: round(v, 1) for k, v in rows[side][-1].items()}), flush=True)
    print(f"\n{platform.node()} {os.cpu_count()} cores, Python {platform.python_version()}")
    print("| job runner | processes | RSS (MB) | CPU of the live tree (s) | until /health answers (s) |")
    print("|---|---|---|---|---|")
    for side in ("off", "on"):
        med = {k: statistics.median(r[k] for r in rows[side]) for k in rows[side][0]}
        cells = f"{med['processes']:.0f} | {med['rss_mb']:.0f} | {med['cpu_s']:.1f} | {med['up_s']:.1f}"
        print(f"| {side} | {cells} |")


if __name__ == "__main__":
    main()
