"""A session's cell against a one-off warm call, without a notebook (display off, tracking off).

    python benchmarks/session_vs_call.py [--ranks N] [--cells 30] [--rounds 5]

For machines without Jupyter (the GPU device): the same trivial work as a session cell
(``s.run_cell``) and as a one-off call on warm ranks (``fn.distributed()``), in rounds
whose order alternates; the first round is a warm-up. Medians per way and a bootstrap
90 % interval. ``benchmarks/session_overhead.py`` is the notebook's version (tabs on,
and ipyparallel's ``%%px``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

from stats import median_interval  # benchmarks/stats.py: scripts run as python benchmarks/x.py

import air_magic


def trivial() -> int:
    return 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=None, help="default: every GPU, else 2 CPU ranks")
    parser.add_argument("--cells", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    settings = {"num_accelerators": args.ranks, "display": "none", "tracking": False}
    # share_gpus: the session holds the GPUs; the one-off call runs beside it on the same ones.
    call = air_magic.distributed(**settings, share_gpus=True)(trivial)
    took: dict[str, list[float]] = {"session cell": [], "warm call": []}
    with air_magic.session(**settings) as s:
        for round_ in range(args.rounds + 1):
            ways = list(took) if round_ % 2 else list(reversed(took))
            for way in ways:
                for _ in range(args.cells):
                    start = time.perf_counter()
                    if way == "session cell":
                        s.run_cell("1")
                    else:
                        call.distributed()
                    if round_:
                        took[way].append(time.perf_counter() - start)
        world = s.world_size
    print(
        f"{time.strftime('%Y-%m-%d')} · {platform.node()} · {os.cpu_count()} CPUs · Python "
        f"{platform.python_version()} · {world} rank(s) · {args.cells} x {args.rounds} rounds"
    )
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    for way, values in took.items():
        low, high = median_interval(values)
        print(
            f"{way:<14} median {statistics.median(values) * 1e3:8.2f} ms  [{low * 1e3:.2f}, {high * 1e3:.2f}]"
        )


if __name__ == "__main__":
    main()
