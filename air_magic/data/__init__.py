"""``air_magic.data``: training data and checkpoints inside a rank (the ``[data]`` extra: fsspec, torchdata).

Runs where the training code runs; it knows nothing of the caller's side.

- :class:`VolumeDataset` (alias ``UCVolumeDataset``): the files under a directory
  or fsspec URL as local paths, evenly sharded across ranks and DataLoader
  workers, shuffled per epoch alike on every rank, resumable mid-epoch
  (dataset.py; listing.py, sharding.py, cache.py).
- :class:`DataLoader`: torchdata's ``StatefulDataLoader`` with a per-rank
  ``num_workers`` default and timing metrics for the call's run (loader.py).
- :func:`VolumeWriter` / :func:`VolumeReader` (aliases ``UCVolumeWriter`` /
  ``UCVolumeReader``), :class:`PerRank`, :class:`Checkpointable`: distributed
  checkpoints on the same URLs (checkpoint.py).

Names are imported on first use, so a missing extra is reported by the name that needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "VolumeDataset": "air_magic.data.dataset",
    "UCVolumeDataset": "air_magic.data.dataset",
    "DataLoader": "air_magic.data.loader",
    "VolumeWriter": "air_magic.data.checkpoint",
    "VolumeReader": "air_magic.data.checkpoint",
    "UCVolumeWriter": "air_magic.data.checkpoint",
    "UCVolumeReader": "air_magic.data.checkpoint",
    "PerRank": "air_magic.data.checkpoint",
    "Checkpointable": "air_magic.data.checkpoint",
}

__all__ = [
    "Checkpointable",
    "DataLoader",
    "PerRank",
    "UCVolumeDataset",
    "UCVolumeReader",
    "UCVolumeWriter",
    "VolumeDataset",
    "VolumeReader",
    "VolumeWriter",
]

if TYPE_CHECKING:
    from air_magic.data.checkpoint import (
        Checkpointable,
        PerRank,
        UCVolumeReader,
        UCVolumeWriter,
        VolumeReader,
        VolumeWriter,
    )
    from air_magic.data.dataset import UCVolumeDataset, VolumeDataset
    from air_magic.data.loader import DataLoader


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'air_magic.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
