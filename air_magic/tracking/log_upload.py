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

UPLOAD_EVERY_S = 30.0  # a long run is followed at this pace; the cost is bounded by the rate of output
_CHUNK = 1 << 20


class LogUploader:
    """Sends what is new in ``log_dir`` to the run's ``artifact_path`` (``logs`` or ``logs/call-N``)."""

    def __init__(self, client: Any, run_id: str, log_dir: str, artifact_path: str) -> None:
        self._client = client
        self._run_id = run_id
        self._log_dir = log_dir
        self._artifact_path = artifact_path
        self._sent: dict[str, int] = {}  # file name -> bytes sent
        self._local = _local_folder(client.get_run(run_id).info.artifact_uri, artifact_path)

    def upload(self) -> None:
        """Send every file of the log folder that grew (or was rewritten) since the last pass."""
        try:
            names = sorted(os.listdir(self._log_dir))
        except FileNotFoundError:
            return
        for name in names:
            if name.startswith(RANK_FILE_PREFIX):
                continue  # a rank's stack dump in the making: stacks.txt gathers them (launch/stacks.py)
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
                _append(path, os.path.join(self._local, name), 0 if sent is None or size < sent else sent)
            self._sent[name] = size


def _local_folder(artifact_uri: str, artifact_path: str) -> str | None:
    """The run's artifact folder on this machine, made if missing; None for a remote store."""
    parsed = urllib.parse.urlparse(artifact_uri)
    if parsed.scheme not in ("", "file") or (
        parsed.scheme == "file" and parsed.netloc not in ("", "localhost")
    ):
        return None
    root = urllib.request.url2pathname(parsed.path) if parsed.scheme else artifact_uri
    folder = os.path.join(root, *artifact_path.split("/"))
    os.makedirs(folder, mode=0o700, exist_ok=True)  # a store's artifacts are the user's (security.md)
    return folder


def _append(source: str, target: str, start: int) -> None:
    """Copy ``source`` from byte ``start`` onto the end of ``target`` (from 0: replace it)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if start else os.O_TRUNC)
    fd = private_files.open_private(target, flags)
    with open(source, "rb") as src, os.fdopen(fd, "wb") as out:
        src.seek(start)
        while chunk := src.read(_CHUNK):
            out.write(chunk)
