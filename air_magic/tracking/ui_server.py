"""The keeper of a store's shared MLflow UI server: runs ``mlflow server`` while it is wanted.

    python -m air_magic.tracking.ui_server FOLDER URI PORT [--idle-s S] [--check-s S]

``tracking/ui.py`` starts this in a session of its own and records it in
FOLDER/ui.json. It outlives the kernel that started it, by design: the run links
in a notebook keep working across kernel restarts and in other kernels. It runs
``mlflow server`` over URI on 127.0.0.1:PORT with umask 077, its output in the
0600 FOLDER/ui.log, at a lower CPU priority than ranks (``nice``: its start takes
seconds of CPU while a call's ranks start too). It stops the server, with its whole
process tree, when

- SIGTERM, SIGINT or SIGHUP reaches the keeper (``air-magic ui --stop``, a logout);
- ui.json no longer names this keeper (another server replaced it), or nobody has
  touched it for ``--idle-s`` (every call that links to the server touches it);
- the server exits on its own (its port was taken, the store is broken): then the
  keeper exits too, and the next call starts a new one.

On its way out it marks ui.json ended (keeping the port) if that still names it.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time

from air_magic import paths, private_files
from air_magic.process_tree import stop_trees

IDLE_S = 24 * 3600.0  # a day without a call: the notebooks are closed; the server's memory goes back
CHECK_S = 30.0  # how often ui.json is looked at: an idle stop a little late costs nothing
GRACE_S = 5.0  # mlflow server's workers get this long after SIGTERM to exit on their own
NICENESS = 10  # below the ranks: the server's start must not slow a call starting beside it


def server_command(folder: str, uri: str, port: int) -> list[str]:
    """``mlflow server`` over ``uri`` on loopback, as the keeper runs it (and as docs quote it)."""
    return [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", uri,
        # Artifacts of experiments created through this server go beside the store, not into
        # whatever folder the server runs in (MLflow's default is ./mlartifacts).
        "--artifacts-destination", "file://" + os.path.join(folder, paths.MLFLOW_SERVED_ARTIFACTS),
        "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1",
    ]  # fmt: skip


def read_record(folder: str) -> dict[str, object] | None:
    """ui.json as written by ``tracking/ui.py`` (None: missing or unreadable)."""
    try:
        with open(os.path.join(folder, paths.MLFLOW_UI_STATE)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def locked(folder: str) -> int:
    """Take the folder's ``ui.lock`` (exclusive); the caller closes the returned fd to release it."""
    fd = os.open(
        os.path.join(folder, paths.MLFLOW_UI_LOCK),
        os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
    )
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="air_magic.tracking.ui_server")
    parser.add_argument("folder")
    parser.add_argument("uri")
    parser.add_argument("port", type=int)
    parser.add_argument("--idle-s", type=float, default=IDLE_S)
    parser.add_argument("--check-s", type=float, default=CHECK_S)
    args = parser.parse_args(argv)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    me = private_files.owner_tag()
    os.umask(0o077)  # what the server writes (artifacts of its experiments) is the user's alone
    os.nice(NICENESS)
    private_files.private_subfolder(os.path.join(args.folder, paths.MLFLOW_SERVED_ARTIFACTS))
    with open(os.path.join(args.folder, paths.MLFLOW_UI_LOG), "ab", opener=private_files.opener) as log:
        server = subprocess.Popen(
            server_command(args.folder, args.uri, args.port),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            cwd=args.folder,
            start_new_session=True,  # its own group: stopped as a whole, never signalling the keeper
        )
    _record_server(args.folder, me, server.pid)

    # The server's own exit ends the wait at once: the next call must find no stale ui.json.
    def watch_server() -> None:
        server.wait()
        stop.set()

    threading.Thread(target=watch_server, daemon=True).start()
    why = ""
    try:
        while not why and not stop.wait(args.check_s):
            why = _unwanted(args.folder, me, args.idle_s)
        if server.poll() is not None:
            why = f"the server exited with status {server.returncode}"
    finally:
        stop_trees([server], GRACE_S)
        _forget(args.folder, me, why or "stopped")
    print(f"air_magic: MLflow UI on port {args.port} ended: {why or 'stopped'}", file=sys.stderr, flush=True)
    return 0


def _unwanted(folder: str, me: str, idle_s: float) -> str:
    """Why the server should stop now ("" while it is wanted)."""
    fd = locked(folder)  # the starter writes ui.json under this lock: never read it half-written
    try:
        record = read_record(folder)
        if record is None or record.get("keeper") != me:
            return "ui.json names another server"
        try:
            idle = time.time() - os.stat(os.path.join(folder, paths.MLFLOW_UI_STATE)).st_mtime
        except OSError:
            return "ui.json is gone"
        return f"no call for {idle:.0f} s" if idle > idle_s else ""
    finally:
        os.close(fd)


def _record_server(folder: str, me: str, pid: int) -> None:
    """Add the server's process group to ui.json: if this keeper is killed (SIGKILL, the OOM
    killer), the next starter stops what it left (``tracking/ui.py``)."""
    fd = locked(folder)
    try:
        record = read_record(folder)
        if record is not None and record.get("keeper") == me:
            record["group"] = pid  # the server leads its group (start_new_session)
            write_record(folder, record)
    finally:
        os.close(fd)


def write_record(folder: str, record: dict[str, object]) -> None:
    """Replace ui.json at once (0600), under ``ui.lock``: readers see the old one or the new one."""
    path = os.path.join(folder, paths.MLFLOW_UI_STATE)
    with open(path + ".tmp", "w", opener=private_files.opener) as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def _forget(folder: str, me: str, why: str) -> None:
    """ui.json, if it still names this keeper, says the server has ended; its port stays, so
    that the next server takes it again when it is free (old links work again)."""
    fd = locked(folder)
    try:
        record = read_record(folder)
        if record is not None and record.get("keeper") == me:
            write_record(folder, {"port": record.get("port"), "uri": record.get("uri"), "ended": why})
    finally:
        os.close(fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
