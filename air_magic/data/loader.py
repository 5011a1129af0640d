"""``DataLoader``: torchdata's ``StatefulDataLoader`` with a per-rank worker default and timing metrics.

The loading itself is torchdata's (workers, prefetch, pinning, and a
``state_dict()`` that counts delivered batches). What this adds:

- ``num_workers`` defaults to this rank's part of the machine's cores
  (cores / ranks on this machine, at most :data:`MAX_DEFAULT_WORKERS`); with a
  :class:`VolumeDataset`, workers take whole batches, so every rank delivers
  the same number of batches whatever its number of workers;
- worker states travel to the loader every :data:`SNAPSHOT_EVERY_N_STEPS`
  batches, not every batch (exact all the same: see below);
- a state resumes on a machine with another number of cores: a loader whose
  ``num_workers`` was left to the default takes the saved state's number of
  workers (torchdata resumes only with the same split of the work); one given
  another number explicitly is refused in words, not with torchdata's bare
  ``AssertionError`` at the first batch;
- ``multiprocessing_context`` ``"fork"``, ``"forkserver"`` and ``"spawn"`` all
  work in warm-started ranks as in fresh ones (tested);
- the seed's timing metrics, per rank, to the call's tracked run: the mean
  time ``next()`` waited for a batch (``dataloader/fetch_seconds/rank_N``) and
  the mean time the training code spent between two ``next()`` calls
  (``dataloader/between_next_seconds/rank_N``), at most every
  ``metrics_every_s`` and at the end of each epoch, through the batched
  metric file (``worker/metrics.append``): no MLflow call per batch, no
  MLflow import at all.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterator
from typing import Any

from air_magic.data.dataset import STATE_KIND, VolumeDataset
from air_magic.data.extra import require
from air_magic.worker import metrics

MAX_DEFAULT_WORKERS = 8  # beyond this, more worker processes mostly cost memory
METRICS_EVERY_S = 10.0
# torchdata ships every worker's state with every batch by default (26 % of the loop on small
# files with 2 workers, measured: docs/benchmarks.md). Every 32 batches instead, state_dict()
# stays exact: a restore replays the batches since the last snapshot (up to 31: their files are
# read again, remote ones fetched again if evicted, and none is delivered).
SNAPSHOT_EVERY_N_STEPS = 32

_stateful = require("torchdata.stateful_dataloader")


def default_num_workers() -> int:
    """This rank's share of the cores it may run on: cores / ranks on this machine (0: load in the rank)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return min(MAX_DEFAULT_WORKERS, cores // local_ranks)


class DataLoader(_stateful.StatefulDataLoader):  # type: ignore[name-defined]
    """``torchdata.stateful_dataloader.StatefulDataLoader``; ``num_workers=None`` picks this rank's share."""

    def __init__(
        self,
        dataset: Any,
        *args: Any,
        num_workers: int | None = None,
        metrics_every_s: float = METRICS_EVERY_S,
        snapshot_every_n_steps: int = SNAPSHOT_EVERY_N_STEPS,
        **kwargs: Any,
    ):
        self._workers_chosen = num_workers is not None  # else a saved state's number may replace it
        if num_workers is None:
            num_workers = default_num_workers()
        kwargs["snapshot_every_n_steps"] = snapshot_every_n_steps
        if isinstance(dataset, VolumeDataset):
            if kwargs.get("persistent_workers") and num_workers > 0:
                raise ValueError(
                    "air_magic.data: persistent_workers=True keeps each worker's copy of the "
                    "VolumeDataset, so set_epoch() would never reach it (every epoch the same order); "
                    "leave it False"
                )
            batch_size = kwargs.get("batch_size", args[0] if args else 1)
            # Workers take whole batches: the number of batches is the same whatever num_workers is.
            dataset.batch_size = batch_size if isinstance(batch_size, int) and batch_size > 0 else 1
        with warnings.catch_warnings():  # torchdata calls an API torch deprecated: not the user's concern
            warnings.filterwarnings("ignore", message=".*set_vital.*", category=UserWarning)
            super().__init__(dataset, *args, num_workers=num_workers, **kwargs)
        self.metrics_every_s = metrics_every_s
        self._timer = _Timer(int(os.environ.get("RANK", "0")), metrics_every_s)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = saved_workers(state_dict)
        workers: int = getattr(self, "num_workers", 0)
        if saved is not None and saved != workers:
            if self._workers_chosen:
                raise ValueError(
                    f"air_magic.data: this loader state was saved by a loader with num_workers={saved}; "
                    f"this one has num_workers={workers}. torchdata resumes a position only with "
                    f"the same workers: pass num_workers={saved} (or leave it out to take the state's)"
                )
            # The default is this machine's share of cores: the saved split wins (resumed exactly).
            self.num_workers = saved
            if saved > 0 and getattr(self, "prefetch_factor", None) is None:
                self.prefetch_factor = 2  # torch's default with workers
        super().load_state_dict(state_dict)

    def __iter__(self) -> Iterator[Any]:
        pending = getattr(self, "next_iter_state", None)  # a loaded state, for the next iteration
        if pending is not None and isinstance(self.dataset, VolumeDataset):
            saved = saved_epochs(pending)
            if saved and max(saved) < self.dataset.epoch:
                # set_epoch() chose a later epoch after the state was loaded: the saved epoch is
                # over, this iteration is the new one (torchdata would finish the saved one first,
                # an empty pass when the state was taken after its last batch).
                self.next_iter_state = None
        return _Timed(super().__iter__(), self._timer)


def saved_workers(state: Any) -> int | None:
    """How many workers the loader that saved ``state`` had (None: not a loader state we know)."""
    if not isinstance(state, dict) or not state:
        return None
    if "_num_workers" in state:
        return int(state["_num_workers"])
    for value in state.values():
        found = saved_workers(value) if isinstance(value, dict) else None
        if found is not None:
            return found
    return 0 if "_num_yielded" in state else None  # a single-process loader's state


def saved_epochs(state: Any) -> list[int]:
    """The epochs of the VolumeDataset states inside a loader state (one per worker)."""
    found: list[int] = []
    if isinstance(state, dict):
        if state.get("kind") == STATE_KIND:
            return [int(state["epoch"])]
        for value in state.values():
            found += saved_epochs(value)
    elif isinstance(state, list | tuple):
        for value in state:
            found += saved_epochs(value)
    return found


class _Timer:
    """Waits in ``next()`` and gaps between ``next()`` calls, summed and written out now and then."""

    def __init__(self, rank: int, every_s: float):
        self.keys = (f"dataloader/fetch_seconds/rank_{rank}", f"dataloader/between_next_seconds/rank_{rank}")
        self.every_s = every_s
        self.batches = 0  # delivered, all epochs: the metrics' step
        self._fetch = self._between = 0.0
        self._fetches = self._betweens = 0
        self._last_write = time.monotonic()

    def fetched(self, seconds: float) -> None:
        self.batches += 1
        self._fetch += seconds
        self._fetches += 1
        if time.monotonic() - self._last_write >= self.every_s:
            self.write()

    def between(self, seconds: float) -> None:
        self._between += seconds
        self._betweens += 1

    def write(self) -> None:
        values = {}
        if self._fetches:
            values[self.keys[0]] = self._fetch / self._fetches
        if self._betweens:
            values[self.keys[1]] = self._between / self._betweens
        self._fetch = self._between = 0.0
        self._fetches = self._betweens = 0
        self._last_write = time.monotonic()
        if values:
            metrics.append(values, self.batches)


class _Timed:
    """The loader's iterator, timed; everything else (``state_dict``, ``__len__``...) is the loader's own."""

    def __init__(self, inner: Iterator[Any], timer: _Timer):
        self._inner = inner
        self._timer = timer
        self._returned_at: float | None = None

    def __iter__(self) -> _Timed:
        return self

    def __next__(self) -> Any:
        asked = time.perf_counter()
        if self._returned_at is not None:
            self._timer.between(asked - self._returned_at)
        try:
            batch = next(self._inner)
        except StopIteration:
            self._returned_at = None
            self._timer.write()  # an epoch's end: what is left of the window
            raise
        self._returned_at = time.perf_counter()
        self._timer.fetched(self._returned_at - asked)
        return batch

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
