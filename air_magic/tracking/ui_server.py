"""The keeper of a store's shared MLflow UI server: runs ``mlflow server`` while it is wanted.

    MLFLOW_BACKEND_STORE_URI=URI python -m air_magic.tracking.ui_server FOLDER PORT
        [--allowed-hosts HOST[,HOST...]] [--allowed-origins ORIGIN[,ORIGIN...]] [--idle-s S] [--check-s S]

``tracking/ui.py`` starts this in a session of its own and records it in the
folder's state file (:func:`state_path`: one per boot and pid namespace, so a
record left by another boot, container or machine sharing the home folder is
never taken for a live one). It outlives the kernel that started it, by design:
the run links in a notebook keep working across kernel restarts and in other
kernels. It runs ``mlflow server`` over the store on 127.0.0.1:PORT with umask
077, its output in the 0600 FOLDER/ui.log, at a lower CPU priority than ranks
(``nice``: its start takes seconds of CPU while a call's ranks start too). The
store's URI travels in the environment, never on a command line (``/proc/*/cmdline``
is readable by every local user, and a database URI may hold a password). Its
environment is :func:`minimal_environment` of its starter's, never the whole of it: the
server lives up to a day, and a kernel's environment holds its secrets. The server
answers only the Host names and CORS origins it is given (``--allowed-hosts``,
``--allowed-origins``: the link's own, see ``ui.allowed_names``), never ``*``.

It stops the server, with its whole process tree, when

- SIGTERM, SIGINT or SIGHUP reaches the keeper (``air-magic ui --stop``, a logout);
- the state file no longer names this keeper (another server replaced it), or nobody
  has touched it for ``--idle-s`` (every call that links to the server touches it);
- the server exits on its own (its port was taken, the store is broken).

Before stopping the server it marks the state file ended (keeping the port, for
the next server), under the lock, so no call links to a server on its way out.
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
from collections.abc import Mapping, Sequence

from air_magic import paths, private_files
from air_magic.process_tree import stop_trees
from air_magic.protocol import env_names

IDLE_S = 24 * 3600.0  # a day without a call: the notebooks are closed; the server's memory goes back
CHECK_S = 30.0  # how often the state file is looked at: an idle stop a little late costs nothing
GRACE_S = 5.0  # mlflow server's workers get this long after SIGTERM to exit on their own
NICENESS = 10  # below the ranks: the server's start must not slow a call starting beside it
# MLflow's job runner (a huey consumer pool, for server-side jobs that a UI over a store never
# runs): on by default, it costs the server's start about 15 s of CPU and 8 more processes.
JOB_EXECUTION_ENV = env_names.MLFLOW_SERVER_JOB_EXECUTION


def state_path(folder: str) -> str:
    """This boot's and pid namespace's state file of the UI folder."""
    return os.path.join(folder, paths.MLFLOW_UI_STATE.format(space=private_files.pid_space()))


def server_command(folder: str, port: int, hosts: Sequence[str], origins: Sequence[str] = ()) -> list[str]:
    """``mlflow server`` on loopback, as the keeper runs it (the store: MLFLOW_BACKEND_STORE_URI).

    ``hosts``: the Host headers it answers (MLflow compares each exactly, a ``*`` in one being a
    pattern: only the loopback names on any port are); ``origins``: the CORS origins it allows
    beside MLflow's own loopback ones. Neither is ever ``*``: a browser page of any site could
    then read the store, or rebind a name of its own to 127.0.0.1 (DNS rebinding) and delete runs.
    """
    patterns = [name for name in hosts if "*" in name and name not in LOOPBACK_HOST_PATTERNS]
    if not hosts or patterns or any("," in n for n in hosts) or any("*" in n or "," in n for n in origins):
        raise ValueError(f"the UI server's allowed hosts and origins must be exact names: {hosts} {origins}")
    command = [
        sys.executable, "-m", "mlflow", "server",
        # Artifacts of experiments created through this server go beside the store, not into
        # whatever folder the server runs in (MLflow's default is ./mlartifacts).
        "--artifacts-destination", "file://" + os.path.join(folder, paths.MLFLOW_SERVED_ARTIFACTS),
        "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1",
        "--allowed-hosts", ",".join(hosts),
    ]  # fmt: skip
    if origins:
        command += ["--cors-allowed-origins", ",".join(origins)]
    return command


LOOPBACK_HOST_PATTERNS = ("127.0.0.1:*", "localhost:*")


def loopback_hosts(port: int) -> list[str]:
    """The Host headers that name the server on loopback, as a browser on this machine sends them:
    any port, for an SSH tunnel or an editor's port forward (``-L 5000:127.0.0.1:PORT`` sends
    ``localhost:5000``). Safe from DNS rebinding: a page of another site cannot send these."""
    return [f"127.0.0.1:{port}", f"localhost:{port}", *LOOPBACK_HOST_PATTERNS]


def minimal_environment(env: Mapping[str, str]) -> dict[str, str]:
    """What the keeper and its server get of their starter's environment: what runs Python and
    MLflow (``env_names.UI_SERVER_KEPT``, ``LC_*``, ``PYTHON*``, ``MLFLOW_*`` but its credentials
    and tracking variables), nothing else: not a kernel's secrets, for a server that lives a day."""
    kept = {}
    for name, value in env.items():
        if name.startswith("MLFLOW_") and any(w in name for w in env_names.UI_SERVER_DROPPED_WORDS):
            continue
        if name in env_names.UI_SERVER_KEPT or name.startswith(env_names.UI_SERVER_KEPT_PREFIXES):
            kept[name] = value
    return kept


def server_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The server's environment: the keeper's (minimal), with MLflow's job runner off unless the
    user set it."""
    return {JOB_EXECUTION_ENV: "false", **minimal_environment(env)}


def read_record(path: str) -> dict[str, object] | None:
    """A state file as written by ``tracking/ui.py`` (None: missing or unreadable)."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_record(path: str, record: dict[str, object]) -> None:
    """Replace a state file at once (0600), under the lock: readers see the old one or the new one."""
    with open(path + ".tmp", "w", opener=private_files.opener) as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


class LockBusy(Exception):
    """The folder's lock stayed taken past the wait (a process stopped while holding it)."""


def locked(folder: str, wait_s: float | None = None) -> int:
    """Take the folder's ``ui.lock`` (exclusive); close the returned fd to release it.

    ``wait_s``: give up after that long (:class:`LockBusy`), so a holder stopped with Ctrl-Z
    cannot hang every tracked call; None waits as long as it takes.
    """
    fd = os.open(
        os.path.join(folder, paths.MLFLOW_UI_LOCK),
        os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
    )
    if wait_s is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise LockBusy(f"{folder}/{paths.MLFLOW_UI_LOCK} stayed locked for {wait_s:g} s") from None
            time.sleep(0.02)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="air_magic.tracking.ui_server")
    parser.add_argument("folder")
    parser.add_argument("port", type=int)
    parser.add_argument(
        "--allowed-hosts",
        default="",
        help="comma-separated Host headers to answer (127.0.0.1:PORT, localhost:PORT)",
    )
    parser.add_argument("--allowed-origins", default="", help="comma-separated CORS origins to allow")
    parser.add_argument("--idle-s", type=float, default=IDLE_S)
    parser.add_argument("--check-s", type=float, default=CHECK_S)
    args = parser.parse_args(argv)

    stop = threading.Event()

    def on_signal(*_: object) -> None:
        # Set from another thread: the main thread may hold the Event's lock inside wait().
        threading.Thread(target=stop.set, daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    me = private_files.owner_tag()
    path = state_path(args.folder)
    os.umask(0o077)  # what the server writes (artifacts of its experiments) is the user's alone
    os.nice(NICENESS)
    private_files.private_subfolder(os.path.join(args.folder, paths.MLFLOW_SERVED_ARTIFACTS))
    with open(os.path.join(args.folder, paths.MLFLOW_UI_LOG), "ab", opener=private_files.opener) as log:
        server = subprocess.Popen(
            server_command(
                args.folder,
                args.port,
                [h for h in args.allowed_hosts.split(",") if h] or loopback_hosts(args.port),
                [o for o in args.allowed_origins.split(",") if o],
            ),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            cwd=args.folder,
            env=server_environment(dict(os.environ)),
            start_new_session=True,  # its own group: stopped as a whole, never signalling the keeper
        )
    _update(args.folder, path, me, {"group": server.pid, "server": private_files.process_tag(server.pid)})

    # The server's own exit ends the wait at once: the next call must find no stale record.
    def watch_server() -> None:
        server.wait()
        stop.set()

    threading.Thread(target=watch_server, daemon=True).start()
    why = ""
    try:
        while not why and not stop.wait(args.check_s):
            why = _unwanted(args.folder, path, me, args.idle_s)
        if not why:
            why = (
                f"the server exited with status {server.returncode}"
                if server.poll() is not None
                else "stopped"
            )
    finally:
        _forget(args.folder, path, me, why or "stopped")  # first: no call links to it from now on
        stop_trees([server], GRACE_S)
    print(f"air_magic: MLflow UI on port {args.port} ended: {why}", file=sys.stderr, flush=True)
    return 0


def _unwanted(folder: str, path: str, me: str, idle_s: float) -> str:
    """Why the server should stop now ("" while it is wanted)."""
    fd = locked(folder)  # the starter writes the state file under this lock: never read it half-written
    try:
        record = read_record(path)
        if record is None or record.get("keeper") != me:
            return "the state file names another server"
        try:
            idle = time.time() - os.stat(path).st_mtime
        except OSError:
            return "the state file is gone"
        return f"no call for {idle:.0f} s" if idle > idle_s else ""
    finally:
        os.close(fd)


def _update(folder: str, path: str, me: str, fields: dict[str, object]) -> None:
    """Add ``fields`` to the state file if it still names this keeper."""
    fd = locked(folder)
    try:
        record = read_record(path)
        if record is not None and record.get("keeper") == me:
            write_record(path, {**record, **fields})
    finally:
        os.close(fd)


def _forget(folder: str, path: str, me: str, why: str) -> None:
    """The state file, if it still names this keeper, says the server has ended; its port stays,
    so that the next server takes it again when it is free (old links work again)."""
    fd = locked(folder)
    try:
        record = read_record(path)
        if record is not None and record.get("keeper") == me:
            write_record(path, {"port": record.get("port"), "uri_key": record.get("uri_key"), "ended": why})
    finally:
        os.close(fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
