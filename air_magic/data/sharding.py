"""Which files a rank's DataLoader worker reads in an epoch: the order, then an even share.

Pure functions of (number of files, seed, epoch, rank, world, worker): every
rank computes the whole epoch's order itself, identically, with no
communication. The order is shuffled from ``seed`` and the epoch, so
``set_epoch(e)`` gives a new order that every rank agrees on.

Even shares are what keep DDP from hanging: every rank gets the same number
of files, so every rank runs the same number of steps. ``drop_last=True``
leaves out the last ``n % world`` files of the epoch's order (other files each
epoch, since the order changes); ``drop_last=False`` pads the order by
repeating its first files, so every file is read at least once and a few twice.
Within a rank, whole batches go round-robin to its DataLoader workers: a rank
delivers ``ceil(files / batch_size)`` batches whatever its number of workers
(ranks with different core counts pick different defaults), in the share's
order (the loader takes one batch from each worker in turn).
"""

from __future__ import annotations

import math
import random


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """Indexes of the ``n`` files in the order the epoch reads them (the same on every rank)."""
    order = list(range(n))
    if shuffle:
        # A str seed is hashed with SHA-512 (not hash()): the same order in every process.
        random.Random(f"air_magic.data:{seed}:{epoch}").shuffle(order)
    return order


def per_rank(n: int, world: int, drop_last: bool) -> int:
    """How many files each rank reads per epoch."""
    return n // world if drop_last else math.ceil(n / world)


def rank_share(order: list[int], rank: int, world: int, drop_last: bool) -> list[int]:
    """This rank's files of the epoch: the same count on every rank."""
    n = len(order)
    count = per_rank(n, world, drop_last)
    if count == 0:
        raise ValueError(
            f"air_magic.data: {n} file(s) for {world} ranks: with drop_last=True no rank gets a file "
            "(use drop_last=False to repeat files, or fewer ranks)"
        )
    total = count * world
    padded = order[:total] if total <= n else [order[i % n] for i in range(total)]
    return padded[rank::world]


def worker_share(share: list[int], worker: int, num_workers: int, batch_size: int = 1) -> list[int]:
    """A DataLoader worker's part of its rank's share: batches ``worker``, ``worker + num_workers``, ..."""
    batches = [share[i : i + batch_size] for i in range(0, len(share), batch_size)]
    return [index for batch in batches[worker::num_workers] for index in batch]
