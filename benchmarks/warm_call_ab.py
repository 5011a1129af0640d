"""A/B of the warm call between two checkouts of air_magic: did a change make the hot path slower?

    git worktree add /tmp/before <commit>
    python benchmarks/warm_call_ab.py /tmp/before . [--pairs 6] [--calls 10]

One sample is one process of a tree: one warm-up call, then ``--calls`` warm trivial
2-rank calls (tracking and display off), and their median. Processes alternate
A, B then B, A (never always A first), ``--pairs`` times; the output is each pair's
medians, their ratio B/A, and the median ratio with its range.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import statistics, sys, time
tree, calls = sys.argv[1], int(sys.argv[2])
sys.path[:0] = [tree, tree + "/benchmarks"]
from trivial_job import trivial
import air_magic
assert air_magic.__file__.startswith(tree), air_magic.__file__
fn = air_magic.distributed(num_accelerators=2, display="none", tracking=False)(trivial)
fn.distributed()
fn.distributed()
samples = []
for _ in range(calls):
    began = time.perf_counter()
    fn.distributed()
    samples.append(time.perf_counter() - began)
print(statistics.median(samples))
"""


def sample(tree: str, calls: int) -> float:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, os.path.abspath(tree), str(calls)],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",  # neither tree is on the path by accident
    )
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} on {os.uname().nodename}: {os.cpu_count()} cores")
    print(f"# command: python benchmarks/warm_call_ab.py {args.a} {args.b} --pairs {args.pairs}")
    print("| pair | A (s) | B (s) | B / A |\n|---|---|---|---|")
    ratios = []
    for pair in range(args.pairs):
        order = ("a", "b") if pair % 2 == 0 else ("b", "a")
        got = {side: sample(getattr(args, side), args.calls) for side in order}
        ratios.append(got["b"] / got["a"])
        print(f"| {pair + 1} | {got['a']:.4f} | {got['b']:.4f} | {ratios[-1]:.2f} |")
    print(f"\nmedian B / A: {statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
