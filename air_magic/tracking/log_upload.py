"""A call's log folder copied into its MLflow run while the call runs, not only at its end.

:class:`~air_magic.tracking.run.TrackedRun` calls :meth:`LogUploader.upload`
on its owner thread every :data:`UPLOAD_EVERY_S` seconds from the ranks' start,
and once more at the end, so a long run can be followed from the MLflow UI
(its artifacts, ``logs/rank-N.log``). Only files that changed since the last
pass are sent. With a local artifact store (the embedded one, any ``file:``
location) the new bytes are appended to the artifact in place, so a pass costs
what was written since the previous one; with a remote store the changed files
are uploaded whole (MLflow has no append).
"""

from __future__ import annotations

import os
import urllib.parse
import urllib.request
from typing import Any

from air_magic import private_files
from air_magic.protocol.stacks import RANK_FILE_PREFIX

UPLOAD_EVERY_S = 30.0  # a long run is followed at this pace; locally a pass costs what was written
# A remote store gets whole files each pass (MLflow has no append): a slower pace keeps the traffic
# of a long run's growing logs down, and the run's owner thread free for the call's own requests.
REMOTE_UPLOAD_EVERY_S = 300.0
_CHUNK = 1 << 20


class LogUploader:
    """Sends what is new in ``log_dir`` to the run's ``artifact_path`` (``logs`` or ``logs/call-N``)."""

    def __init__(self, client: Any, run_id: str, log_dir: str, artifact_path: str, private: bool) -> None:
        self._client = client
        self._run_id = run_id
        self._log_dir = log_dir
        self._artifact_path = artifact_path
        self._private = private  # the embedded store: 0600 files, refused through links (security.md)
        self._sent: dict[str, int] = {}  # file name -> bytes sent
        self._local = _local_folder(client.get_run(run_id).info.artifact_uri, artifact_path, private)

    @property
    def remote(self) -> bool:
        """The run's artifacts are not on this machine: each pass uploads changed files whole."""
        return self._local is None

    def upload(self) -> None:
        """Send every file of the log folder that grew (or was rewritten) since the last pass."""
        try:
            names = sorted(os.listdir(self._log_dir))
        except FileNotFoundError:
            return
        for name in names:
            if name.startswith(RANK_FILE_PREFIX):
                continue  # a rank's stack dump in the making: stacks.txt gathers them (outcome/stacks.py)
            path = os.path.join(self._log_dir, name)
            if not os.path.isfile(path) or os.path.islink(path):
                continue
            size = os.path.getsize(path)
            sent = self._sent.get(name)
            if sent == size:
                continue
            if self._local is None:
                self._client.log_artifact(self._run_id, path, self._artifact_path)
            else:
                start = 0 if sent is None or size < sent else sent
                # Exactly the bytes up to the size read above: more may be written meanwhile,
                # and the next pass starts from here (never twice).
                _append(path, os.path.join(self._local, name), start, size, self._private)
            self._sent[name] = size


def _local_folder(artifact_uri: str, artifact_path: str, private: bool) -> str | None:
    """The run's artifact folder on this machine, made if missing; None for a remote store."""
    parsed = urllib.parse.urlparse(artifact_uri)
    if parsed.scheme not in ("", "file") or (
        parsed.scheme == "file" and parsed.netloc not in ("", "localhost")
    ):
        return None
    root = urllib.request.url2pathname(parsed.path) if parsed.scheme else artifact_uri
    folder = os.path.join(root, *artifact_path.split("/"))
    # The embedded store's artifacts are the user's alone (security.md); a store the user chose
    # keeps the modes its folders get (a team's shared store stays readable to the team).
    os.makedirs(folder, mode=0o700 if private else 0o777, exist_ok=True)
    return folder


def _append(source: str, target: str, start: int, end: int, private: bool) -> None:
    """Copy bytes ``start``..``end`` of ``source`` onto the end of ``target`` (from 0: replace it)."""
    # Not O_APPEND: copy_file_range refuses such a target; the writes go from its end instead.
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (0 if start else os.O_TRUNC)
    out = private_files.open_private(target, flags) if private else os.open(target, flags, 0o666)
    try:
        src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.lseek(out, 0, os.SEEK_END)
            _copy(src, out, start, end - start)
        finally:
            os.close(src)
    finally:
        os.close(out)


def _copy(src: int, out: int, offset: int, left: int) -> None:
    """``left`` bytes of ``src`` from ``offset`` to ``out``'s position: in the kernel where it can.

    A flood's log is hundreds of MB at the end of a call: copy_file_range does it without
    passing the bytes through Python (a reflink on filesystems that share blocks)."""
    copy_range = getattr(os, "copy_file_range", None)
    while left > 0 and copy_range is not None:
        try:
            done = copy_range(src, out, min(left, 1 << 30), offset)
        except OSError:  # another filesystem on an old kernel, a special file: copy by hand
            break
        if done == 0:  # the end of the source, or a filesystem that copies nothing this way
            break
        offset += done
        left -= done
    while left > 0 and (chunk := os.pread(src, min(_CHUNK, left), offset)):
        offset += len(chunk)
        left -= len(chunk)
        view = memoryview(chunk)
        while view:
            view = view[os.write(out, view) :]
