"""``air-magic run`` against ``torchrun --standalone``: wall time of the trivial 2-rank job from a shell.

    python benchmarks/cli_vs_torchrun.py [--pairs 7] [--nproc 2] [--torchrun-line]

``--torchrun-line``: ``air-magic run`` gets torchrun's own line (``--standalone
--nproc-per-node=N``, docs/torchrun.md) instead of ``-n N``.

Both run ``benchmarks/trivial_job.py`` (init, one all_reduce, destroy) as a
script, each as a fresh process, as a user types it: this measures the
**cold path** (a new caller, so a new warm starter that imports torch; nothing
is kept between commands). ``air-magic run`` runs untracked (``--no-tracking``:
torchrun records nothing either). Interleaved pairs, the order alternating;
the median of each side, the median of the per-pair difference and its range.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "trivial_job.py")


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--torchrun-line", action="store_true", help="air-magic run with torchrun's flags")
    args = parser.parse_args()
    bindir = os.path.dirname(sys.executable)
    line = ["--standalone", f"--nproc-per-node={args.nproc}"]
    ours = [os.path.join(bindir, "air-magic"), "run", "--no-tracking"]
    ours += [*line, JOB] if args.torchrun_line else ["-n", str(args.nproc), JOB]
    theirs = [os.path.join(bindir, "torchrun"), *line, JOB]
    timed(ours), timed(theirs)  # the page cache warm for both
    a, b = [], []
    for pair in range(args.pairs):
        if pair % 2 == 0:
            a.append(timed(ours))
            b.append(timed(theirs))
        else:
            b.append(timed(theirs))
            a.append(timed(ours))
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}: {os.cpu_count()} cores, "
        f"torch {torch.__version__}"
    )
    flag = " --torchrun-line" if args.torchrun_line else ""
    print(f"# command: python benchmarks/cli_vs_torchrun.py --pairs {args.pairs} --nproc {args.nproc}{flag}")
    print("| launcher (trivial job, cold: a fresh process each time) | wall time, median (s) |")
    print("|---|---|")
    print(f"| air-magic run --no-tracking {' '.join(ours[3:-1])} | {statistics.median(a):.2f} |")
    print(f"| torchrun --standalone | {statistics.median(b):.2f} |")
    print(
        f"| difference, air-magic - torchrun (median of {args.pairs} pairs; range) | "
        f"{statistics.median(diffs):+.2f} ({min(diffs):+.2f} to {max(diffs):+.2f}) |"
    )


if __name__ == "__main__":
    main()
