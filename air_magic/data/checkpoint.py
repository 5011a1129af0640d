"""Distributed checkpoints (``torch.distributed.checkpoint``) on the same URLs as the data.

:class:`VolumeWriter` / :class:`VolumeReader` are DCP's storage for a local
directory (DCP's ``FileSystemWriter`` / ``Reader``) or any fsspec URL (DCP's
fsspec storage), chosen by the URL: ``dcp.save(state, storage_writer=VolumeWriter(url))``.
DCP saves each shard once and loads onto another number of ranks (resharding).

State that differs per rank and is not a tensor — a data loader's position —
must not share one key across ranks: DCP keeps one copy of a non-tensor value
per key. :class:`PerRank` stores it under the rank's own key. Read through
:func:`VolumeReader`, a checkpoint says how many ranks saved each PerRank entry (the
count of its ``rank_N`` keys), and loading it on another number of ranks is refused by
``PerRank.load_state_dict`` with a message that says so (on more ranks than saved it
DCP itself would stop first, at a bare "Missing key"). Other readers load it unchecked.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
from typing import Any, Protocol, runtime_checkable

import torch.distributed.checkpoint as dcp

from air_magic.data.extra import require


@runtime_checkable
class Checkpointable(Protocol):
    """What DCP (``Stateful``) and torchdata's loader call: models, optimizers, datasets, loaders."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _local_path(url: str) -> str:
    return url[len("file://") :] if url.startswith("file://") else url


# Named like classes (the seed's names); functions, because the URL picks the class.
def VolumeWriter(url: str | os.PathLike[str], **kwargs: Any) -> dcp.StorageWriter:
    """DCP storage that writes a checkpoint to ``url`` (a directory, made if missing)."""
    url = os.fspath(url)
    if _is_local(url):
        return dcp.FileSystemWriter(_local_path(url), **kwargs)
    require("fsspec")
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(url, **kwargs)


def VolumeReader(url: str | os.PathLike[str], **kwargs: Any) -> dcp.StorageReader:
    """DCP storage that reads a checkpoint from ``url``."""
    url = os.fspath(url)
    if _is_local(url):
        if not os.path.isdir(_local_path(url)):
            raise FileNotFoundError(f"air_magic.data: no checkpoint at {url!r}")
        return _checks_rank_count(dcp.FileSystemReader(_local_path(url), **kwargs), url)
    require("fsspec")
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return _checks_rank_count(FsspecReader(url, **kwargs), url)


_RANK_KEY = re.compile(r"^(?P<prefix>.+)\.rank_(?P<rank>\d+)$")
# The rank counts of the PerRank entries in the checkpoint this process read last (its metadata
# is read by VolumeReader just before DCP loads the state: the same dcp.load call).
_saved_rank_counts: dict[str, int] = {}


def _checks_rank_count(reader: Any, url: str) -> Any:
    """``reader``, noting how many ranks saved each :class:`PerRank` entry of the checkpoint (its
    ``prefix.rank_N`` keys, whose values are bytes), and readable on more ranks than saved it.

    DCP's planner refuses a key the checkpoint lacks (``Missing key in checkpoint state_dict:
    loader.rank_2``) before any state is loaded, in words that do not say why. Here the missing
    ranks' keys point at rank 0's bytes, so the load goes on to ``PerRank.load_state_dict``, which
    compares the rank counts and says what differs. A state without that PerRank never asks for
    those keys: loading the rest (tensors reshard) is untouched. Nothing is added to what is
    saved: checkpoints of every version load alike."""
    read_metadata = reader.read_metadata

    def read_metadata_for_this_many_ranks(*args: Any, **kwargs: Any) -> Any:
        metadata = read_metadata(*args, **kwargs)
        known = getattr(metadata, "state_dict_metadata", None)
        _saved_rank_counts.clear()
        if not isinstance(known, dict):
            return metadata
        ranks: dict[str, set[int]] = {}
        for key, about in known.items():
            found = _RANK_KEY.match(key)
            if found and type(about).__name__ == "BytesStorageMetadata":
                ranks.setdefault(found["prefix"], set()).add(int(found["rank"]))
        _, world = _world()
        for prefix, saved in ranks.items():
            if saved != set(range(len(saved))):
                continue  # not rank_0..rank_N-1: not PerRank's
            _saved_rank_counts[prefix] = len(saved)
            first = f"{prefix}.rank_0"
            where = [(i, info) for i, info in (metadata.storage_data or {}).items() if i.fqn == first]
            for rank in range(len(saved), world):
                fqn = f"{prefix}.rank_{rank}"
                known[fqn] = known[first]
                for index, info in where:
                    metadata.storage_data[dataclasses.replace(index, fqn=fqn)] = info
        return metadata

    reader.read_metadata = read_metadata_for_this_many_ranks
    return reader


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _check_ranks(saved: int) -> None:
    _, world = _world()
    if saved != world:
        raise ValueError(
            f"air_magic.data: this checkpoint's PerRank state was saved by {saved} rank(s); this call "
            f"has {world}. Per-rank state (a loader's position) cannot be spread over another number "
            f"of ranks: load it with {saved} ranks (num_accelerators={saved}), or leave the PerRank "
            "entry out of the state to load the rest (tensors reshard)."
        )


UCVolumeWriter = VolumeWriter
UCVolumeReader = VolumeReader


class PerRank:
    """``inner``'s state under this rank's own key, as one opaque value: put it in a DCP state dict.

    ``{"loader": PerRank(loader)}`` saves every rank's loader position and gives
    each rank back its own on load (the same number of ranks is needed to load it).
    """

    def __init__(self, inner: Checkpointable):
        self.inner = inner

    def _key(self) -> str:
        return f"rank_{_world()[0]}"

    def state_dict(self) -> dict[str, Any]:
        # Bytes, not the nested dict: DCP would flatten it, and loading a flattened dict needs
        # the same keys in the fresh object's state as in the saved one (a loader's are not).
        return {self._key(): pickle.dumps(self.inner.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = self._key()
        for saved in set(_saved_rank_counts.values()):  # read through VolumeReader: its rank counts
            _check_ranks(saved)
        if key not in state_dict:
            raise KeyError(f"air_magic.data: the checkpoint has no state for {key} (saved by fewer ranks?)")
        self.inner.load_state_dict(pickle.loads(state_dict[key]))
