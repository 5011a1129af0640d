"""The local copy of remote files: a folder shared by every rank and worker of this machine.

A remote file is fetched once per machine (through its fsspec filesystem's
``get_file``) into a part file, then published with ``os.replace``: a reader
sees a whole file or none. fsspec's own ``simplecache`` writes in place and
has no size bound, so this small cache does the two things it lacks:

- **atomic publish, one download**: the downloading process holds an ``flock``
  on its part file; another process that wants the same entry waits for it
  instead of fetching it again, and a part file whose lock is free was left by
  a process that died: it is deleted.
- **a size bound** (``max_bytes``): before a download, room is reserved under
  one exclusive ``flock`` for the folder, evicting the least recently used
  entries (a hit touches its mtime, under the same lock, shared). Reservations
  count, so ranks downloading at once stay within the bound together. An entry
  used in the last :data:`RECENT_S` is never evicted (a path just handed out is
  about to be opened); when nothing older is left, a download waits.

An evicted file that a process still has open stays readable (POSIX).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

from air_magic.data.listing import RemoteFile

_PART = ".part-"  # .part-<unique>-<reserved bytes>-<entry>: a download in progress (flock held)
_LOCK = ".lock"
_WAIT_S = 0.05
_GIVE_UP_S = 600.0  # waiting for room (held by other downloads) or for another process's download
RECENT_S = 2.0  # an entry used this recently is not evicted


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
        size, asked = file.size, False
        while True:
            with self._locked(exclusive=False):  # an eviction sees this use, or comes before it
                if _touch(final):
                    return final
            if size == 0 and self.max_bytes is not None and not asked:  # the listing did not say (http)
                size, asked = int(fs.info(file.path).get("size") or 0), True
            if self.max_bytes is not None and size > self.max_bytes:
                raise ValueError(
                    f"air_magic.data: {file.path} ({size} bytes) does not fit in the cache "
                    f"{self.root} (max_cache_bytes={self.max_bytes}): raise max_cache_bytes above the "
                    "largest file, or read it without a cache"
                )
            reserved = self._reserve(name, size)
            if reserved is not None:
                break
            if time.monotonic() > give_up:
                raise TimeoutError(f"air_magic.data: no room in the cache {self.root} for {file.path}")
            time.sleep(_WAIT_S)  # another process is fetching it, or the room is held
        part, lock_fd = reserved
        try:
            fs.get_file(file.path, part)
            os.replace(part, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(part)
            raise
        finally:
            os.close(lock_fd)  # the part file's lock: released once it is published (or gone)
        if size == 0 and self.max_bytes is not None:  # its size is still unknown: make room now
            with self._locked():
                self._evict(0, keep=name)
        return final

    # -- room --------------------------------------------------------------------------

    def _reserve(self, name: str, size: int) -> tuple[str, int] | None:
        """A part file (and its held lock) to download into, with room for ``size`` bytes; None: wait."""
        with self._locked():
            if os.path.exists(os.path.join(self.root, name)):
                return None  # published meanwhile: the next look finds it
            parts = self._parts()
            if any(entry == name for _, entry in parts):
                return None  # another process is fetching it
            if not self._evict(size, reserved=sum(bytes_ for bytes_, _ in parts)):
                return None
            part = os.path.join(self.root, f"{_PART}{uuid.uuid4().hex}-{size}-{name}")
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)  # held until published: alive to the others
            return part, fd

    def _evict(self, size: int, reserved: int | None = None, keep: str | None = None) -> bool:
        """Delete least recently used entries until ``size`` more bytes fit; False (deleting nothing)
        if they cannot fit yet."""
        if self.max_bytes is None:
            return True
        if reserved is None:
            reserved = sum(bytes_ for bytes_, _ in self._parts())
        used = 0
        old = []
        recent_since = time.time() - RECENT_S
        for entry in os.scandir(self.root):
            if entry.name.startswith(_PART) or entry.name == _LOCK:
                continue
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            used += st.st_size
            if entry.name != keep and st.st_mtime < recent_since:
                old.append((st.st_mtime, st.st_size, entry.path))
        if used - sum(bytes_ for _, bytes_, _ in old) + reserved + size > self.max_bytes:
            return False  # even without every old entry it would not fit: wait, delete nothing
        old.sort()
        while used + reserved + size > self.max_bytes:
            _, bytes_, path = old.pop(0)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            used -= bytes_
        return True

    def _parts(self) -> list[tuple[int, str]]:
        """Downloads in progress (reserved bytes, entry); part files of dead processes are deleted."""
        parts = []
        for entry in os.scandir(self.root):
            if not entry.name.startswith(_PART):
                continue
            _, size, name = entry.name[len(_PART) :].split("-", 2)
            if _held(entry.path):
                parts.append((int(size), name))
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
        return parts

    @contextlib.contextmanager
    def _locked(self, exclusive: bool = True) -> Iterator[None]:
        fd = os.open(os.path.join(self.root, _LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
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


def _held(path: str) -> bool:
    """Its downloader still holds the part file's lock (False: it died, or just published it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
