"""Links to a call's MLflow run, and a real MLflow UI server over the embedded store.

With an HTTP tracking URI the link points at that server. With a local store
(the embedded sqlite one) there is no page to link to until
``%distributed mlflow-ui`` (or :func:`start_ui`) starts ``mlflow server`` on
127.0.0.1 on a free port, in the background, under ``air_magic.tracking.guard`` so it
stops when this process ends; from then on runs link to it. The server runs
with umask 077 and logs to a 0600 ``ui.log``: what it writes beside the
embedded store is private like the store (docs/security.md).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

from air_magic import paths, private_files
from air_magic.process_tree import stop_trees

_servers: dict[str, str] = {}  # tracking URI -> UI base URL
_lifelines: list[int] = []  # write ends, held open for this process's lifetime
_guards: list[subprocess.Popen[bytes]] = []
GUARD_EXIT_S = 15.0  # a guard gives its server 3 s after SIGTERM; mlflow's workers may take longer


def run_url(uri: str, experiment_id: str, run_id: str) -> str | None:
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else _servers.get(uri)
    if base is None:
        return None
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


def start_ui(uri: str, timeout_s: float = 90.0) -> str:
    """Start (once) an MLflow UI server for ``uri`` on loopback; return its base URL.

    ``timeout_s``: ``mlflow server`` takes seconds to answer (it imports MLflow and its server
    app, and migrates an old store first); 90 s leaves room for a loaded machine.
    """
    if uri in _servers:
        return _servers[uri]
    if uri.startswith(("http://", "https://")):
        return uri.rstrip("/")
    folder = private_files.private_root(
        paths.embedded_mlflow_dir(),
        "the embedded MLflow store's folder",
        "Set AIR_MAGIC_MLFLOW_DIR to a folder only you can write",
    )
    log_path = os.path.join(folder, paths.MLFLOW_UI_LOG)
    port = _free_port()
    artifacts = private_files.private_subfolder(os.path.join(folder, paths.MLFLOW_SERVED_ARTIFACTS))
    command = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", uri,
        # Artifacts of experiments created through this server go beside the store, not into
        # whatever folder the notebook runs in (MLflow's default is ./mlartifacts).
        "--artifacts-destination", "file://" + artifacts,
        "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1",
    ]  # fmt: skip
    lifeline, keep = os.pipe()
    _lifelines.append(keep)
    try:
        with open(log_path, "ab", opener=private_files.opener) as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "air_magic.tracking.guard", str(lifeline), "--", *command],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                pass_fds=(lifeline,),
                start_new_session=True,
                cwd=folder,
                umask=0o077,  # what the server writes (artifacts of its experiments) is the user's alone
            )
    finally:
        os.close(lifeline)
    _guards.append(proc)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the MLflow UI server exited with status {proc.returncode}; see {log_path}")
        try:
            # 2 s: a loopback server that is up answers at once; one that hangs is asked again.
            with urllib.request.urlopen(f"{base}/health", timeout=2) as reply:
                if reply.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the MLflow UI server did not answer within {timeout_s:g} s; see {log_path}")
        time.sleep(0.2)  # 5 polls a second: ready soon after the server is, at negligible cost
    _servers[uri] = base
    return base


def _free_port() -> int:
    # The kernel picks a free port; mlflow binds it a moment later (a small window, on loopback).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_ui() -> None:
    """Stop every UI server this process started (they also stop when it exits)."""
    while _lifelines:
        os.close(_lifelines.pop())  # EOF: each guard stops its server (SIGTERM, grace, SIGKILL)
    guards, _guards[:] = list(_guards), []
    stop_trees(guards, GUARD_EXIT_S, ask=None)
    _servers.clear()
