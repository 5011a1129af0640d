"""Distributed checkpoints (``torch.distributed.checkpoint``) on the same URLs as the data.

:class:`VolumeWriter` / :class:`VolumeReader` are DCP's storage for a local
directory (DCP's ``FileSystemWriter`` / ``Reader``) or any fsspec URL (DCP's
fsspec storage), chosen by the URL: ``dcp.save(state, storage_writer=VolumeWriter(url))``.
DCP saves each shard once and loads onto another number of ranks (resharding).

State that differs per rank and is not a tensor — a data loader's position —
must not share one key across ranks: DCP keeps one copy of a non-tensor value
per key. :class:`PerRank` stores it under the rank's own key.
"""

from __future__ import annotations

import os
import pickle
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
        return dcp.FileSystemReader(_local_path(url), **kwargs)
    require("fsspec")
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(url, **kwargs)


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
        import torch.distributed as dist

        rank = (
            dist.get_rank()
            if dist.is_available() and dist.is_initialized()
            else int(os.environ.get("RANK", "0"))
        )
        return f"rank_{rank}"

    def state_dict(self) -> dict[str, Any]:
        # Bytes, not the nested dict: DCP would flatten it, and loading a flattened dict needs
        # the same keys in the fresh object's state as in the saved one (a loader's are not).
        return {self._key(): pickle.dumps(self.inner.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = self._key()
        if key not in state_dict:
            raise KeyError(f"air_magic.data: the checkpoint has no state for {key} (saved by fewer ranks?)")
        self.inner.load_state_dict(pickle.loads(state_dict[key]))
