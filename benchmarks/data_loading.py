"""Files per second through ``air_magic.data`` against plain ``torch.utils.data``, and the cache cold vs warm.

    python benchmarks/data_loading.py [--files 4000] [--kib 16] [--pairs 7] [--workers 0 2]
                                      [--decode] [--parts]

1. Local folder: the same files read (opened, read whole, length summed per
   batch of 16; with ``--decode`` each also becomes a float tensor) through
   ``VolumeDataset`` + ``air_magic.data.DataLoader``, and through a plain map-style
   dataset of the sorted paths + ``torch.utils.data.DataLoader``
   (with a ``DistributedSampler``, as a DDP user would, shuffled). Interleaved
   pairs, the order alternating; the median of each side and of the per-pair ratio,
   with the ratio's range.
2. A remote store: the same files served by an HTTP server on 127.0.0.1
   (fsspec's http://), read through the cache: cold (an empty cache folder, every
   file downloaded) then warm (every file a hit), per pair.

One process, rank 0 of 1 (the loader's work per rank does not depend on the world).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import platform
import statistics
import tempfile
import threading
import time

import torch
import torch.utils.data as tud

from air_magic.data import DataLoader, VolumeDataset

DECODE = False  # --decode: each file also becomes a float tensor, as an image decode would


def read_batch(paths: list[str]) -> int:
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        if DECODE:
            total += int(torch.frombuffer(bytearray(data), dtype=torch.uint8).float().mean() > 0)
        else:
            total += len(data)
    return total


class PlainFiles(tud.Dataset[str]):
    def __init__(self, root: str):
        self.paths = sorted(os.path.join(d, n) for d, _, names in os.walk(root) for n in names)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> str:
        return self.paths[i]


def make_files(root: str, count: int, kib: int) -> None:
    os.makedirs(root)
    block = os.urandom(kib * 1024)
    for i in range(count):
        with open(os.path.join(root, f"f{i:05d}.bin"), "wb") as f:
            f.write(block)


def files_per_s(loader: object, count: int) -> float:
    start = time.perf_counter()
    read = sum(1 for _ in loader)  # type: ignore[attr-defined]
    took = time.perf_counter() - start
    assert read > 0
    return count / took


def ours(root: str, workers: int) -> float:
    dataset = VolumeDataset(root, seed=0, drop_last=False)
    loader = DataLoader(dataset, batch_size=16, num_workers=workers, collate_fn=read_batch)
    return files_per_s(loader, len(dataset))


def plain(root: str, workers: int) -> float:
    dataset = PlainFiles(root)
    sampler = tud.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = tud.DataLoader(
        dataset, batch_size=16, sampler=sampler, num_workers=workers, collate_fn=read_batch
    )
    return files_per_s(loader, len(dataset))


def parts(root: str, workers: int, rounds: int) -> None:
    """Where the difference goes: the same loop with one piece changed at a time."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    dataset = VolumeDataset(root, seed=0, drop_last=False)
    n = len(dataset)
    cases = {
        "plain: map-style paths + torch DataLoader": lambda: plain(root, workers),
        "VolumeDataset + torch DataLoader": lambda: files_per_s(
            tud.DataLoader(dataset, batch_size=16, num_workers=workers, collate_fn=read_batch), n
        ),
        "VolumeDataset + StatefulDataLoader (its default: a snapshot every batch)": lambda: files_per_s(
            StatefulDataLoader(dataset, batch_size=16, num_workers=workers, collate_fn=read_batch), n
        ),
        "VolumeDataset + air_magic.data.DataLoader": lambda: ours(root, workers),
    }
    got: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds):
        order = list(cases) if r % 2 == 0 else list(reversed(cases))
        for name in order:
            got[name].append(cases[name]())
    print()
    print(f"| {workers} worker(s): loop | files/s (median of {rounds} rounds, order alternating) |")
    print("|---|---|")
    for name, values in got.items():
        print(f"| {name} | {statistics.median(values):,.0f} |", flush=True)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


class QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # fsspec reads a file's size from the start of a GET, then hangs up: not an error


def remote(url: str, cache: str, workers: int) -> float:
    dataset = VolumeDataset(url, seed=0, drop_last=False, cache_dir=cache)
    loader = DataLoader(dataset, batch_size=16, num_workers=workers, collate_fn=read_batch)
    return files_per_s(loader, len(dataset))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", type=int, default=4000)
    parser.add_argument("--kib", type=int, default=16)
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--decode", action="store_true", help="turn each file into a float tensor too")
    parser.add_argument(
        "--parts", action="store_true", help="also: the loop with one piece changed at a time"
    )
    args = parser.parse_args()
    global DECODE
    DECODE = args.decode
    work = tempfile.mkdtemp(prefix="air-magic-data-bench-")
    root = os.path.join(work, "files")
    make_files(root, args.files, args.kib)
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}: {os.cpu_count()} cores, "
        f"torch {torch.__version__}"
    )
    print(
        f"# command: python benchmarks/data_loading.py --files {args.files} --kib {args.kib} "
        f"--pairs {args.pairs} --workers {' '.join(map(str, args.workers))}"
        f"{' --decode' * args.decode}{' --parts' * args.parts}"
    )
    print(
        f"# {args.files} files of {args.kib} KiB{' (decoded)' * args.decode}, batches of 16; "
        f"files/s, median of {args.pairs} interleaved pairs"
    )
    print()
    print("| workers | plain torch DataLoader | VolumeDataset + DataLoader | ours / plain (range) |")
    print("|---|---|---|---|")
    for workers in args.workers:
        ours(root, workers), plain(root, workers)  # warm the page cache and the imports
        a, b, ratios = [], [], []
        for pair in range(args.pairs):
            if pair % 2 == 0:
                x, y = ours(root, workers), plain(root, workers)
            else:
                y, x = plain(root, workers), ours(root, workers)
            a.append(x)
            b.append(y)
            ratios.append(x / y)
        print(
            f"| {workers} | {statistics.median(b):,.0f} | {statistics.median(a):,.0f} | "
            f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |",
            flush=True,
        )

    if args.parts:
        for workers in args.workers:
            parts(root, workers, args.pairs)

    server = QuietServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=root))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    print()
    print("| workers | remote (loopback HTTP), cold cache | warm cache | warm / cold |")
    print("|---|---|---|---|")
    for workers in args.workers:
        cold, hot = [], []
        for pair in range(args.pairs):
            cache = os.path.join(work, f"cache-{workers}-{pair}")
            cold.append(remote(url, cache, workers))
            hot.append(remote(url, cache, workers))
        print(
            f"| {workers} | {statistics.median(cold):,.0f} | {statistics.median(hot):,.0f} | "
            f"{statistics.median(hot) / statistics.median(cold):.1f}x |",
            flush=True,
        )
    server.shutdown()


if __name__ == "__main__":
    main()
