"""Warm start, caller side: one starter process per caller, forking ranks that skip ``import torch``.

The first call of a process (or ``%load_ext air_magic``) starts the starter at
once, before the caller's own imports, and the call waits for it: its import of
torch is the same work a cold rank would do, done once instead of once per rank.
Later calls fork from the ready starter (see starter_main.py), which saves each
rank the import of torch (2 s on a laptop, 4-5 s on a GPU node).
The starter is rebuilt when it would be stale: another interpreter, another
``sys.path``, another preload list, or packages installed or removed since
(a site-packages folder's modification time changed). ``restart()`` rebuilds
it on request; ``AIR_MAGIC_WARM=0`` (or ``warm_start=False``) turns it off.

Preloaded modules: ``AIR_MAGIC_PRELOAD`` (comma-separated), default ``torch``.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Any

_BOOTSTRAP = (
    "import json,sys;sys.path[:]=json.loads(sys.argv[3]);"
    "from air_magic.starter_main import main;main(int(sys.argv[1]),json.loads(sys.argv[2]))"
)
_lock = threading.Lock()
_starter: Starter | None = None


def enabled() -> bool:
    return os.environ.get("AIR_MAGIC_WARM", "1") not in ("0", "false", "no", "off")


def preload_list() -> list[str]:
    raw = os.environ.get("AIR_MAGIC_PRELOAD")
    names = [n.strip() for n in raw.split(",")] if raw is not None else ["torch"]
    return [n for n in names if n and importlib.util.find_spec(n.split(".")[0]) is not None]


def fingerprint(preload: list[str]) -> str:
    """What the starter's preloaded modules depend on. Installing or removing a package
    changes its site-packages folder's modification time; other folders (the notebook's,
    the temp folder) change all the time and do not matter: ranks import them afresh."""
    stamps = []
    for entry in sys.path:
        if os.path.basename(entry.rstrip(os.sep)) in ("site-packages", "dist-packages"):
            try:
                stamps.append(os.stat(entry).st_mtime_ns)
            except OSError:
                stamps.append(0)
    return json.dumps([sys.executable, sys.path, preload, stamps])


class Starter:
    """The caller's handle on its starter process."""

    def __init__(self, preload: list[str], log_path: str | None = None):
        self.preload = preload
        self.fingerprint = fingerprint(preload)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed below
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _BOOTSTRAP,
                    str(child.fileno()),
                    json.dumps(preload),
                    json.dumps(sys.path),
                ],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        finally:
            child.close()
            if out is not subprocess.DEVNULL:
                out.close()  # type: ignore[union-attr]
        self.sock = parent
        self.ready = False
        self.broken = False
        self.exits: dict[int, int] = {}
        self._lock = threading.Lock()

    def fileno(self) -> int:
        return self.sock.fileno()

    def is_ready(self, wait_s: float = 0.0) -> bool:
        """True once the starter has imported its preload list (waits up to ``wait_s``)."""
        if self.ready or self.broken:
            return self.ready
        with self._lock:
            deadline = time.monotonic() + wait_s
            while not self.ready and not self.broken:
                if not self._receive(max(0.0, deadline - time.monotonic())):
                    break
        return self.ready

    def spawn(self, env: dict[str, str], cwd: str, run_dir: str, fds: list[int]) -> int:
        with self._lock:
            message = json.dumps({"op": "spawn", "env": env, "cwd": cwd, "run_dir": run_dir}).encode()
            socket.send_fds(self.sock, [message], fds)
            deadline = time.monotonic() + 30.0
            while True:
                # Exit reports of ranks started earlier can come first: they are stored, not answers.
                reply = self._receive(max(0.0, deadline - time.monotonic()))
                if reply is None:
                    self.broken = True
                    raise OSError("the warm starter did not answer")
                pid = reply.get("spawned")
                if pid is not None:
                    if type(pid) is not int or pid <= 1 or pid == os.getpid():
                        self.broken = True
                        raise OSError(f"the warm starter answered with an impossible pid {pid!r}")
                    return pid

    def poll(self, pid: int) -> int | None:
        with self._lock:
            while self._receive(0.0):
                pass
            return self.exits.get(pid)

    def _receive(self, timeout: float) -> dict[str, Any] | None:
        """Read one message if one comes within ``timeout``, record what it says, and return it."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return None
        try:
            data = self.sock.recv(1 << 20)
        except OSError:
            data = b""
        if not data:
            self.broken = True
            return None
        message: dict[str, Any] = json.loads(data)
        if "ready" in message:
            self.ready = True
        elif "exited" in message:
            self.exits[message["exited"]] = message["code"]
        elif "error" in message:
            self.broken = True
            return None
        return message

    def alive(self) -> bool:
        return not self.broken and self.proc.poll() is None

    def close(self) -> None:
        self.broken = True
        self.sock.close()  # EOF: the starter kills what it started and exits
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


STARTER_WAIT_S = 120.0  # past this, a call gives up on the starter and starts its ranks cold


def prestart(log_root: str | None = None) -> None:
    """Make sure a starter is on its way, without waiting for it."""
    get_starter(log_root, wait_s=0.0)


def get_starter(log_root: str | None = None, wait_s: float = 0.0) -> Starter | None:
    """The ready starter for this caller (waiting up to ``wait_s``), or None; starts one if needed."""
    global _starter
    if not enabled():
        return None
    preload = preload_list()
    with _lock:
        if _starter is not None and (not _starter.alive() or _starter.fingerprint != fingerprint(preload)):
            _starter.close()
            _starter = None
        if _starter is None:
            from air_magic.output import default_log_root

            root = log_root or default_log_root()
            os.makedirs(root, mode=0o700, exist_ok=True)
            _starter = Starter(preload, os.path.join(root, "starter.log"))
        starter = _starter
    return starter if starter.is_ready(wait_s) else None


@atexit.register
def restart() -> None:
    """Stop the starter; the next call starts a fresh one (after installing packages, say)."""
    global _starter
    with _lock:
        if _starter is not None:
            _starter.close()
            _starter = None


def starter_pid() -> int | None:
    return _starter.proc.pid if _starter is not None and _starter.alive() else None
