"""Launch latency of a trivial job: air_magic's ``.distributed()`` against torchrun, same run.

    python benchmarks/launch_latency.py [--ranks 2] [--repeats 5]

Each sample is the wall time of one whole call: start the ranks, init the
process group, one all_reduce, destroy, collect. The first air_magic call is
reported separately (it imports torch in the caller for the rendezvous store).
Prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from trivial_job import trivial  # noqa: E402

from air_magic import distributed  # noqa: E402


def time_air_magic(ranks: int, repeats: int) -> tuple[float, list[float]]:
    fn = distributed(num_accelerators=ranks, display="none")(trivial)
    samples = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        assert fn.distributed() == [float(ranks)] * ranks
        samples.append(time.perf_counter() - start)
    return samples[0], samples[1:]


def time_torchrun(ranks: int, repeats: int) -> list[float]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={ranks}", os.path.join(HERE, "trivial_job.py"),
    ]  # fmt: skip
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        samples.append(time.perf_counter() - start)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}: {os.cpu_count()} cores, "
          f"Python {platform.python_version()}")  # fmt: skip
    print(f"# command: python benchmarks/launch_latency.py --ranks {' '.join(map(str, args.ranks))} "
          f"--repeats {args.repeats}")  # fmt: skip
    print("| ranks | air_magic first call (s) | air_magic median (s) | torchrun median (s) | ratio |")
    print("|---|---|---|---|---|")
    for ranks in args.ranks:
        first, warm = time_air_magic(ranks, args.repeats)
        tr = time_torchrun(ranks, args.repeats)
        am, trm = statistics.median(warm), statistics.median(tr)
        print(f"| {ranks} | {first:.2f} | {am:.2f} | {trm:.2f} | {trm / am:.1f}x faster |", flush=True)


if __name__ == "__main__":
    main()
