"""How long ``fn.distributed_async(...)`` takes to give its handle back, against a foreground call.

A background call does every check a foreground call does (arguments, settings,
payload, GPUs in use) before it returns, then hands the rest to a thread (or, with
``detach=True``, to a supervisor process). Measured in one process, interleaved
(foreground, background, detached, ...), after a warm-up call of each kind:

- ``foreground``: ``fn.distributed()`` of a trivial function, start to result;
- ``background``: ``fn.distributed_async()`` until the handle is back, then the time to its result;
- ``detached``: the same with ``detach=True`` (a supervisor process per call, fresh ranks).

python benchmarks/background_return.py [--pairs 7] [--ranks 2] [--tracking]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import air_magic


def trivial(x: int) -> int:
    return x + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tracking", action="store_true", help="record each call in MLflow (default: off)")
    args = parser.parse_args()
    settings = dict(num_accelerators=args.ranks, display="none", tracking=args.tracking)
    fg = air_magic.distributed(**settings)(trivial)
    bg = fg.with_overrides()
    dt = fg.with_overrides(detach=True)
    fg.distributed(1), bg.distributed_async(1).result(), dt.distributed_async(1).result()  # warm-up
    times: dict[str, list[float]] = {"foreground": [], "background returns": [], "background result": []}
    times |= {"detached returns": [], "detached result": []}
    for _ in range(args.pairs):
        t = time.perf_counter()
        fg.distributed(1)
        times["foreground"].append(time.perf_counter() - t)
        for kind, fn in (("background", bg), ("detached", dt)):
            t = time.perf_counter()
            handle = fn.distributed_async(1)
            times[f"{kind} returns"].append(time.perf_counter() - t)
            handle.result(timeout=300)
            times[f"{kind} result"].append(time.perf_counter() - t)
    summary = {
        k: {"median_s": round(statistics.median(v), 4), "max_s": round(max(v), 4)} for k, v in times.items()
    }
    print(
        json.dumps({"ranks": args.ranks, "pairs": args.pairs, "tracking": args.tracking, **summary}, indent=1)
    )


if __name__ == "__main__":
    main()
