"""Output streaming: ranks printing as fast as they can, against the same ranks writing to /dev/null.

    python benchmarks/output_streaming.py [--lines 200000] [--repeats 3]

Reports the median wall time of a 2-rank call whose ranks print N lines each
(captured, logged, shown with the text display), the same with the lines
written to /dev/null inside the rank, the overhead, and lines lost (counted in
the logs; must be 0). Warm ranks, tracking off (the output path is measured).
A third column writes the same lines to the rank's stdout descriptor through a
64 KiB block buffer instead of ``sys.stdout`` (unbuffered in ranks: one write per
line): the same caller path, fewer system calls in the rank.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import statistics
import time

from air_magic import distributed, last_run
from air_magic.backends.local import warm


def chatty(n: int, how: str) -> int:
    import os
    import sys

    if how == "devnull":
        out = open(os.devnull, "w")  # noqa: SIM115
    elif how == "buffered":
        out = open(1, "w", closefd=False, buffering=1 << 16)  # noqa: SIM115
    else:
        out = sys.stdout
    rank = os.environ["RANK"]
    for i in range(n):
        out.write(f"rank {rank} line {i} " + "." * 40 + "\n")
    out.flush()
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    fn = distributed(num_accelerators=2, display="text", tracking=False)(chatty)
    fn.distributed(1, "devnull")
    warm.get_starter(wait_s=120)
    results: dict[str, list[float]] = {"devnull": [], "stdout": [], "buffered": []}
    lost = 0
    for _ in range(args.repeats):
        for how in results:
            start = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                fn.distributed(args.lines, how)
            results[how].append(time.perf_counter() - start)
            if how != "devnull":
                info = last_run()
                for rank in (0, 1):
                    with open(info.log_path(rank)) as f:
                        lost += args.lines - sum(1 for _ in f)
    quiet, loud, buffered = (statistics.median(results[k]) for k in ("devnull", "stdout", "buffered"))
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}: {os.cpu_count()} cores")
    print(f"# command: python benchmarks/output_streaming.py --lines {args.lines} --repeats {args.repeats}")
    print(
        "| lines per rank | to /dev/null (s) | captured + logged + shown (s) | overhead "
        "| the same, block-buffered in the rank (s) | its overhead | lines lost |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {args.lines} | {quiet:.2f} | {loud:.2f} | {(loud / quiet - 1) * 100:.0f} % "
        f"| {buffered:.2f} | {(buffered / quiet - 1) * 100:.0f} % | {lost} |"
    )


if __name__ == "__main__":
    main()
