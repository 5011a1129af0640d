"""The files a dataset reads: one recursive listing of a directory or fsspec URL, made once.

:func:`list_files` runs in the process that builds the dataset (the rank, or
the caller before shipping it); DataLoader workers and later epochs reuse the
list, so a bucket is listed once per dataset, not once per worker or epoch.
The order is the sorted relative path: every rank that lists the same URL gets
the same list, which is what even sharding needs.
"""

from __future__ import annotations

import fnmatch
import os
import posixpath
from dataclasses import dataclass
from typing import Any

from air_magic.data.extra import require


@dataclass(frozen=True)
class RemoteFile:
    """One file of the listing: where it is, its size, and what changes when it is rewritten."""

    path: str  # in the filesystem's own terms (no protocol)
    relative: str  # below the listed root, with "/"
    size: int
    version: str  # ETag, mtime or "": part of the cache key, so a rewritten file is fetched again


@dataclass(frozen=True)
class FileList:
    url: str
    local: bool  # on this machine's filesystem: yielded as they are, never cached
    files: tuple[RemoteFile, ...]

    @property
    def fs(self) -> Any:
        """The URL's fsspec filesystem, made in this process (see :func:`location`)."""
        return location(self.url)[0]


_locations: dict[tuple[int, str], tuple[Any, str]] = {}


def location(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path in it, made once per process.

    Not kept in the dataset: an async filesystem (http, s3, gcs) used before a
    fork fails in the child ("This class is not fork-safe"), and DataLoader
    workers are forks of the rank that listed the files.
    """
    key = (os.getpid(), url)
    found = _locations.get(key)
    if found is None:
        found = require("fsspec.core").url_to_fs(url)
        for other in [k for k in _locations if k[0] != key[0]]:
            del _locations[other]  # a fork's parent's: of no use here
        _locations[key] = found
    return found


def list_files(url: str, pattern: str | None = None) -> FileList:
    """Every file under ``url`` (recursively) whose relative path matches ``pattern`` (fnmatch)."""
    fs, root = location(url)
    if not fs.exists(root):
        raise FileNotFoundError(f"air_magic.data: {url!r} does not exist (nothing to read)")
    local = "file" in _protocols(fs)
    found = fs.find(root, detail=True, withdirs=False)
    files = []
    for path, info in found.items():
        if info.get("type", "file") != "file":
            continue
        relative = posixpath.relpath(path, root) if path != root else posixpath.basename(path)
        if pattern is not None and not fnmatch.fnmatchcase(relative, pattern):
            continue
        version = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or ""
        files.append(RemoteFile(path, relative, int(info.get("size") or 0), str(version)))
    if not files:
        matching = f" matching {pattern!r}" if pattern is not None else ""
        raise ValueError(f"air_magic.data: no files{matching} under {url!r}")
    files.sort(key=lambda f: f.relative)
    return FileList(url=url, local=local, files=tuple(files))


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)
