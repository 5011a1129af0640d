"""Payload: the time and the caller's peak memory for arguments of 1 MB, 100 MB and 1 GB.

    python benchmarks/payload_size.py [--sizes-mb 1 100 1024]

Each rank receives a bytes argument of the given size and returns its length.
The payload is pickled once into the private run folder; every rank reads it
there. Peak memory is the caller's resident set size, sampled every 5 ms,
minus the size before the call. Warm ranks, tracking off.
"""

from __future__ import annotations

import argparse
import os
import platform
import threading
import time

import psutil

from air_magic import distributed
from air_magic.node import warm


def size_of(data: bytes) -> int:
    return len(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 100, 1024])
    args = parser.parse_args()
    fn = distributed(num_accelerators=2, display="none", tracking=False, max_payload_bytes=4 * 2**30)(size_of)
    fn.distributed(b"warm-up")
    warm.get_starter(wait_s=120)
    me = psutil.Process()
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}: {os.cpu_count()} cores")
    print(f"# command: python benchmarks/payload_size.py --sizes-mb {' '.join(map(str, args.sizes_mb))}")
    print("| argument | call (s) | caller's extra peak memory |")
    print("|---|---|---|")
    for mb in args.sizes_mb:
        data = os.urandom(mb * 2**20)
        base = me.memory_info().rss
        peak = [base]
        done = threading.Event()

        def sample(peak=peak, done=done) -> None:
            while not done.is_set():
                peak[0] = max(peak[0], me.memory_info().rss)
                time.sleep(0.005)

        sampler = threading.Thread(target=sample)
        sampler.start()
        start = time.perf_counter()
        assert fn.distributed(data) == [len(data)] * 2
        took = time.perf_counter() - start
        done.set()
        sampler.join()
        print(f"| {mb} MiB | {took:.2f} | {(peak[0] - base) / 2**20:.0f} MiB |", flush=True)
        del data


if __name__ == "__main__":
    main()
