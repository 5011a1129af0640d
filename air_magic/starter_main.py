"""The warm starter process: imports torch once, then forks clean ranks on request.

Started by :mod:`air_magic.warm` as ``python -c ... <control fd> <preload json>``.
It imports the preload list (torch by default) and **never initialises CUDA**,
so a forked rank is as clean as a fresh process, minus the import time. It
talks to its caller over one AF_UNIX SOCK_SEQPACKET socket:

- caller -> starter: ``{"op": "spawn", "env", "cwd", "run_dir"}`` with three
  fds (the rank's stdout and stderr pipes, the lifeline's read end);
- starter -> caller: ``{"ready": ...}`` once, ``{"spawned": pid}`` per request,
  ``{"exited": pid, "code": ...}`` for every rank that ends (exit code as
  ``subprocess`` gives it: negative for a signal).

When the caller goes away (EOF), the starter kills what it started and exits.
A forked rank becomes a session leader, takes its pipes as stdout/stderr and
the caller's environment and working folder, reseeds ``random``, and runs
:func:`air_magic.rank_entry.run_from_launch_file`.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import selectors
import signal
import socket
import sys
import traceback
from typing import Any, NoReturn

_MAX_MESSAGE = 1 << 20


def main(control_fd: int, preload: list[str]) -> None:
    sock = socket.socket(fileno=control_fd)
    loaded, failed = [], {}
    for name in preload:
        try:
            importlib.import_module(name)
            loaded.append(name)
        except Exception as exc:  # noqa: BLE001 - report it; the ranks import it themselves
            failed[name] = repr(exc)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # pragma: no cover - a preload touched CUDA
        _send(sock, {"error": "a preloaded module initialised CUDA; forked ranks would inherit it"})
        return
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    _send(sock, {"ready": {"pid": os.getpid(), "loaded": loaded, "failed": failed}})

    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ, "control")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    while True:
        for key, _ in selector.select():
            if key.data == "child":
                os.read(wake_r, 4096)
                _reap(sock, children)
                continue
            try:
                data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 8)
            except OSError:
                data, fds = b"", []
            if not data:  # the caller is gone
                for pid in children:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except OSError:
                        pass
                return
            request = json.loads(data)
            pid = os.fork()
            if pid == 0:
                _become_rank(request, fds, sock, wake_r, wake_w)
            for fd in fds:
                os.close(fd)
            children.add(pid)
            _send(sock, {"spawned": pid})
        _reap(sock, children)


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    try:
        sock.send(json.dumps(message).encode())
    except OSError:
        pass  # the caller is gone; the main loop notices


def _become_rank(
    request: dict[str, Any], fds: list[int], sock: socket.socket, wake_r: int, wake_w: int
) -> NoReturn:
    try:
        os.setsid()  # its own session and process group, like a fresh rank
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        sock.close()
        os.close(wake_r)
        os.close(wake_w)
        out_w, err_w, lifeline_r = fds
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        for fd in (devnull, out_w, err_w):
            os.close(fd)
        # Unbuffered text streams on the new fds, as `python -u` would give.
        sys.stdout = io.TextIOWrapper(
            io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True
        )
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False),
            write_through=True,
            line_buffering=True,
            errors="backslashreplace",
        )
        env = dict(request["env"])
        env["AIR_MAGIC_LIFELINE_FD"] = str(lifeline_r)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        _fresh_state(env)
        from air_magic.rank_entry import run_from_launch_file

        run_from_launch_file(request["run_dir"])
    except BaseException:  # noqa: BLE001 - a rank that cannot start says why on its stderr
        try:
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(1)
    os._exit(1)  # pragma: no cover - run_from_launch_file never returns


def _fresh_state(env: dict[str, str]) -> None:
    """What a fresh interpreter would have differently from a fork of the starter."""
    import random

    random.seed()  # a fresh process seeds from the OS; a fork would repeat the starter's sequence
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None and env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # read at import, before the fork


if __name__ == "__main__":
    main(int(sys.argv[1]), json.loads(sys.argv[2]))
