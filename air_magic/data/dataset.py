"""``VolumeDataset``: the files under a directory or URL, as local paths, evenly sharded, resumable.

Built where the training code runs (usually inside the rank). It lists the
files once (listing.py); each epoch, every rank computes the same shuffled
order and takes its even share, split again across its DataLoader workers
(sharding.py); remote files are fetched through the machine's cache
(cache.py) and handed out as local paths, like the seed's ``UCVolumeDataset``.

Rank and world come from torch.distributed once it is initialised, else from
the launch environment (``RANK`` / ``WORLD_SIZE``, set for every rank by
air_magic, torchrun or Ray): the dataset may be built before
``init_process_group``.

``state_dict()`` is where this copy of the dataset is in its epoch. Iterated
by a :class:`air_magic.data.DataLoader` (torchdata's ``StatefulDataLoader``),
each worker's copy is saved and restored by the loader, counting only batches
that were delivered; iterated directly, it counts the paths handed out.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch.utils.data

from air_magic import paths
from air_magic.data import sharding
from air_magic.data.cache import FileCache
from air_magic.data.listing import FileList, list_files

_STATE_VERSION = 1
STATE_KIND = "air_magic.data.VolumeDataset"  # found by the loader inside its own nested state


class VolumeDataset(torch.utils.data.IterableDataset[str]):
    """Local paths of the files under ``url``, this rank's and this worker's even share, per epoch.

    ``url``: a local directory (``/Volumes/...`` included) or any fsspec URL
    (``s3://``, ``gs://``, ``hf://``, ``https://``, ...). ``pattern``: fnmatch on
    the path below ``url`` (``"*.parquet"``, ``"train/*"``). ``shuffle`` / ``seed``:
    each epoch's order (``set_epoch``), the same on every rank. ``drop_last``:
    equal shares by leaving out ``n % world`` files (True) or by repeating the
    first files of the order (False). ``cache_dir`` / ``max_cache_bytes``: where
    remote files are kept on this machine (default ``~/.cache/air_magic/data``)
    and the bound on that folder (default: none).
    """

    def __init__(
        self,
        url: str,
        *,
        pattern: str | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        cache_dir: str | None = None,
        max_cache_bytes: int | None = None,
    ):
        super().__init__()
        self.url = str(url)
        self.pattern = pattern
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.listing: FileList = list_files(self.url, pattern)
        self.cache: FileCache | None = None
        if not self.listing.local:
            self.cache = FileCache(cache_dir or paths.cache_dir(paths.DATA_CACHE), max_cache_bytes)
        self.epoch = 0
        self._next = 0  # in this copy's list of the epoch: how many paths were handed out
        self._resumed = False
        self._shape: dict[str, int] = {}
        self._shape_pid = 0
        # Set by air_magic.data.DataLoader: workers take whole batches, so a rank's number of
        # batches does not depend on its number of workers.
        self.batch_size = 1

    # -- what a user asks --------------------------------------------------------------

    def __len__(self) -> int:
        """Files this rank reads per epoch (all its workers together)."""
        _, world = _rank_and_world()
        return sharding.per_rank(len(self.listing.files), world, self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at the next iteration (its own order, the same on every rank)."""
        self.epoch = int(epoch)
        self._next = 0
        self._resumed = False

    def files(self, epoch: int | None = None) -> list[str]:
        """The relative paths this rank (with this worker) reads in ``epoch``, in order, without fetching."""
        return [
            self.listing.files[i].relative for i in self._my_indexes(self.epoch if epoch is None else epoch)
        ]

    def __iter__(self) -> Iterator[str]:
        # Not a generator itself: the position is settled now, not at the first next().
        indexes = self._my_indexes(self.epoch)
        start = self._next if self._resumed else 0
        self._resumed = False
        self._next = start
        return self._paths(indexes[start:])

    def _paths(self, indexes: list[int]) -> Iterator[str]:
        files, cache = self.listing.files, self.cache
        for i in indexes:
            path = files[i].path if cache is None else cache.fetch(self.listing.fs, files[i])
            self._next += 1
            yield path

    # -- resuming ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        # Asked for with every snapshot by torchdata's loader (in each worker): keep it cheap.
        shape = self._shape if self._shape_pid == os.getpid() else self._current_shape()
        return {
            "kind": STATE_KIND,
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "next": self._next,
            **shape,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` was taken: the next iteration hands out exactly the remaining files."""
        now = self._current_shape()
        saved = {key: state.get(key) for key in now}
        if saved != now:
            raise ValueError(
                "air_magic.data: this dataset state was saved with "
                f"{_shape_words(saved)}; now there are {_shape_words(now)}. "
                "A mid-epoch resume needs the same shape (set_epoch(next epoch) starts afresh)"
            )
        if int(state["epoch"]) < self.epoch:
            # set_epoch() chose a later epoch (torchdata loads the state when the iteration
            # starts, after the user's set_epoch): the saved epoch is over, start this one.
            return
        self.epoch = int(state["epoch"])
        self._next = int(state["next"])
        self._resumed = True

    # -- inside ------------------------------------------------------------------------

    def _current_shape(self) -> dict[str, int]:
        """What a saved position is only valid for: files, ranks, workers per rank, batch size, seed."""
        _, world = _rank_and_world()
        _, workers = _worker()
        return {
            "files": len(self.listing.files),
            "world": world,
            "workers": workers,
            "batch_size": self.batch_size,
            "seed": self.seed,
        }

    def _my_indexes(self, epoch: int) -> list[int]:
        # The iteration's shape, for state_dict(); a worker's copy came from its rank (another pid).
        self._shape, self._shape_pid = self._current_shape(), os.getpid()
        rank, world = _rank_and_world()
        worker, workers = _worker()
        order = sharding.epoch_order(len(self.listing.files), self.seed, epoch, self.shuffle)
        share = sharding.rank_share(order, rank, world, self.drop_last)
        return sharding.worker_share(share, worker, workers, self.batch_size)


UCVolumeDataset = VolumeDataset  # the seed's name: a /Volumes/... path is a local directory


def _shape_words(shape: dict[str, Any]) -> str:
    return (
        f"{shape['files']} files, {shape['world']} ranks, {shape['workers']} worker(s) per rank, "
        f"batches of {shape['batch_size']}, seed {shape['seed']}"
    )


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _worker() -> tuple[int, int]:
    info = torch.utils.data.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)
