"""The local copy of remote files: a folder shared by every rank and worker of this machine.

A remote file is fetched once per machine (through its fsspec filesystem's
``get_file``) into a part file, then published with ``os.replace``: a reader
sees a whole file or none. fsspec's own ``simplecache`` writes in place and
has no size bound, so this small cache does the two things it lacks:

- **atomic publish, one download**: a process that finds another live
  process's part file for the same entry waits for it instead of fetching it
  again; a part file left by a dead process is deleted.
- **a size bound** (``max_bytes``): before a download, space is reserved under
  one ``flock`` for the whole folder, evicting the least recently used entries
  (a hit touches its mtime). Reservations count, so two ranks downloading at
  once stay within the bound together.

An evicted file that a process still has open stays readable (POSIX); the
bound should hold the files in flight (ranks x workers x prefetch), or a path
handed out may be gone before it is opened.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import time
from collections.abc import Iterator
from typing import Any

from air_magic.data.listing import RemoteFile

_PART = ".part-"  # .part-<pid>-<reserved bytes>-<entry>: a download in progress
_LOCK = ".lock"
_WAIT_S = 0.05
_GIVE_UP_S = 600.0  # waiting for room (held by other downloads) or for another process's download


class FileCache:
    def __init__(self, root: str, max_bytes: int | None = None):
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"air_magic.data: max_cache_bytes must be positive, not {max_bytes}")
        self.root = root
        self.max_bytes = max_bytes
        os.makedirs(root, mode=0o700, exist_ok=True)

    def entry_name(self, fs: Any, file: RemoteFile) -> str:
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        key = hashlib.sha256(f"{protocol}\0{file.path}\0{file.size}\0{file.version}".encode()).hexdigest()[
            :32
        ]
        base = re.sub(r"[^A-Za-z0-9._-]", "_", file.path.rsplit("/", 1)[-1])[-80:]
        return f"{key}-{base}"  # the file's own name last: its suffix still says what it is

    def fetch(self, fs: Any, file: RemoteFile) -> str:
        """The local path of ``file``, downloading it first if this machine has no copy."""
        name = self.entry_name(fs, file)
        final = os.path.join(self.root, name)
        give_up = time.monotonic() + _GIVE_UP_S
        size = file.size
        while True:
            if _touch(final):
                return final
            if size == 0 and self.max_bytes is not None:  # the listing did not say (http): ask once
                size = int(fs.info(file.path).get("size") or 0)
            part = self._reserve(name, size)
            if part is not None:
                break
            if time.monotonic() > give_up:
                raise TimeoutError(f"air_magic.data: no room in the cache {self.root} for {file.path}")
            time.sleep(_WAIT_S)  # another process is fetching it, or the room is held by downloads
        try:
            fs.get_file(file.path, part)
            os.replace(part, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(part)
            raise
        if size == 0 and self.max_bytes is not None:  # its size is still unknown: make room now
            with self._locked():
                self._evict(0, keep=name)
        return final

    # -- room --------------------------------------------------------------------------

    def _reserve(self, name: str, size: int) -> str | None:
        """A part file to download into, with room for ``size`` bytes; None: wait and try again."""
        if self.max_bytes is not None and size > self.max_bytes:
            raise ValueError(
                f"air_magic.data: a file of {size} bytes does not fit in max_cache_bytes={self.max_bytes}"
            )
        with self._locked():
            if os.path.exists(os.path.join(self.root, name)):
                return None  # published meanwhile: the next look finds it
            for other in self._parts():
                if other[2] == name and _alive(other[0]):
                    return None  # another process is fetching it
            if not self._evict(size):
                return None
            part = os.path.join(self.root, f"{_PART}{os.getpid()}-{size}-{name}")
            with open(part, "wb"):
                pass
            return part

    def _evict(self, size: int, keep: str | None = None) -> bool:
        """Delete least recently used entries until ``size`` more bytes fit; False if they cannot yet."""
        if self.max_bytes is None:
            return True
        entries = []
        used = 0
        for entry in os.scandir(self.root):
            if entry.name.startswith(_PART) or entry.name == _LOCK:
                continue
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            used += st.st_size
            if entry.name != keep:
                entries.append((st.st_mtime, st.st_size, entry.path))
        reserved = sum(bytes_ for _, bytes_, _ in self._parts())
        entries.sort()
        while entries and used + reserved + size > self.max_bytes:
            _, bytes_, path = entries.pop(0)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            used -= bytes_
        return used + reserved + size <= self.max_bytes

    def _parts(self) -> list[tuple[int, int, str]]:
        """Downloads in progress (pid, reserved bytes, entry); those of dead processes are deleted."""
        parts = []
        for entry in os.scandir(self.root):
            if not entry.name.startswith(_PART):
                continue
            pid, size, name = entry.name[len(_PART) :].split("-", 2)
            if _alive(int(pid)):
                parts.append((int(pid), int(size), name))
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
        return parts

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(os.path.join(self.root, _LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def _touch(path: str) -> bool:
    """Mark a hit (least recently used goes first); False if there is no such entry."""
    try:
        os.utime(path)
        return True
    except FileNotFoundError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
