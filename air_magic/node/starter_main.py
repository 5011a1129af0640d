"""The warm starter process: imports torch once, then forks clean ranks on request.

Started by :mod:`air_magic.node.warm` as ``python -c ... <control fd> <preload json>``.
It imports the preload list (torch by default) and **never initialises CUDA**,
so a forked rank is as clean as a fresh process, minus the import time. It
talks to its caller over one AF_UNIX SOCK_SEQPACKET socket:

- caller -> starter: ``{"op": "spawn", "env", "cwd", "call_dir"}`` with three
  fds (the rank's stdout and stderr pipes, the lifeline's read end);
  ``{"op": "store", "host", "port", "world_size", "timeout_s"}`` with three fds (a call's
  rendezvous store's listening socket, its lifeline's read end, its ready pipe): a fork that
  hosts the store (:func:`_become_store_host`), so the caller need not import torch;
- starter -> caller: ``{"ready": ...}`` once, ``{"spawned": pid}`` per request,
  ``{"exited": pid, "code": ...}`` for every rank (and store host) that ends (exit code as
  ``subprocess`` gives it: negative for a signal).

When the caller goes away (EOF), what the starter started ends with its own lifeline
(:data:`CALLER_GONE_GRACE_S` at most, then it is killed), and the starter exits.
A forked rank becomes a session leader, takes its pipes as stdout/stderr and
the caller's environment, working folder and umask, is given what a fresh
interpreter would have of its own (see :func:`_fresh_state`: random seeds, the
SIGINT handler, import caches), and runs
:func:`air_magic.worker.entry.run_from_launch_file`. It ends the way a Python
process ends (threads joined, ``atexit`` run, files flushed): see worker/shutdown.py.

The starter's own environment holds the start-up variables of the calls it
serves (``PYTHONHASHSEED``, ``PYTHONWARNINGS``, ``LD_PRELOAD``...; see
``warm.startup_environment``): they act when a process starts, so a fork can
only inherit them, and the caller rebuilds the starter when a call needs others.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import json
import os
import select
import selectors
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any, NoReturn

from air_magic.protocol import env_names
from air_magic.worker import live_stdout

_MAX_MESSAGE = 1 << 20  # a spawn request holds the rank's environment: large, never a megabyte
# When the caller is gone: how long its forks get to end with their own lifelines before the kill.
CALLER_GONE_GRACE_S = 1.0


_NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
_POISONED = (
    "importing {name!r} in the warm starter initialised CUDA (a CUDA call outside NVML), so ranks "
    "forked from it could not use the GPU: this process's calls start fresh ranks (AIR_MAGIC_PRELOAD "
    "without {name!r} keeps warm start)"
)


def _forks_cannot_use_cuda() -> bool:
    """Whether a fork of this process would find CUDA unusable ("Cannot re-initialize CUDA in
    forked subprocess"): torch says so in a child (a probe fork, a few ms) once the driver was
    touched here."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    if torch.cuda.is_initialized():
        return True
    in_bad_fork = getattr(torch._C, "_cuda_isInBadFork", None)  # absent from CPU-only builds
    if in_bad_fork is None or not _gpus_here():
        return False  # CPU ranks never touch CUDA: a fork that could not is still a good CPU rank
    pid = os.fork()
    if pid == 0:
        os._exit(1 if in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) != 0


def _gpus_here() -> bool:
    from air_magic.launch.accelerators import detect_gpus  # NVML only: no CUDA context

    return bool(detect_gpus())


def main(control_fd: int, preload: list[str]) -> None:
    sock = socket.socket(fileno=control_fd)
    # Before the preload: a rank's own exit hook must run after every atexit hook that
    # torch (or the rank's code) registers, as it does in a fresh rank (atexit is LIFO).
    from air_magic.worker import shutdown  # noqa: F401 - preloaded: a rank's exit must not clear it
    from air_magic.worker.entry import install_exit_hook

    install_exit_hook()
    loaded, failed = [], {}
    # torch.cuda.is_available() (called on import by DeepSpeed, bitsandbytes, torch's own
    # LaunchConfig) asks the CUDA driver, which makes every later fork unable to use the GPU,
    # although torch.cuda.is_initialized() stays False. Through NVML it asks without that cost.
    nvml_check = _NVML_CHECK not in os.environ
    if nvml_check:
        os.environ[_NVML_CHECK] = "1"
    with _exit_if_caller_leaves(sock):
        for name in preload:
            try:
                importlib.import_module(name)
                loaded.append(name)
            except Exception as exc:  # noqa: BLE001 - report it; the ranks import it themselves
                failed[name] = repr(exc)
            if _forks_cannot_use_cuda():
                _send(sock, {"error": _POISONED.format(name=name)})
                return
    if nvml_check:
        del os.environ[_NVML_CHECK]  # a rank's own is_available() is the usual one
    # What the preload made is never collected in a rank (it lives as long as the process):
    # frozen, the garbage collector skips it, so forks keep sharing its pages (no copy on
    # write) and a rank's interpreter shutdown skips walking it (about 0.3 s with torch).
    gc.freeze()
    preloaded = frozenset(sys.modules)  # a rank's exit leaves these alone (worker/shutdown.py)
    _keep_preload_finalizers_from_exit()
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
                _end_children(children)
                return
            request = json.loads(data)
            pid = os.fork()
            if pid == 0 and request.get("op") == "store":  # never returns: ends with the caller's lifeline
                _become_store_host(request, fds, sock, wake_r, wake_w)
            if pid == 0:  # never returns: the rank ends in shutdown.end_forked_rank
                _become_rank(request, fds, sock, wake_r, wake_w, preloaded)
            for fd in fds:
                os.close(fd)
            children.add(pid)
            _send(sock, {"spawned": pid})
        _reap(sock, children)


@contextlib.contextmanager
def _exit_if_caller_leaves(sock: socket.socket) -> Iterator[None]:
    """While the preload runs (seconds: torch), exit as soon as the caller is gone.

    The main loop notices a caller's end only once the preload is over; a kernel shut down
    right after it started its starter would otherwise leave it importing torch on its own.
    The caller sends nothing before ``ready``, so anything readable is the EOF. The watcher
    is stopped and joined before the first fork (a fork must not carry a stray thread).
    """
    stop_r, stop_w = os.pipe()

    def watch() -> None:
        poller = select.poll()  # not select(): the inherited fd may be numbered past 1023
        poller.register(sock.fileno(), select.POLLIN)
        poller.register(stop_r, select.POLLIN)
        if stop_r not in [fd for fd, _ in poller.poll()]:
            os._exit(0)  # nothing of ours to flush or join yet: no rank was started

    watcher = threading.Thread(target=watch, name="air_magic-caller-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        os.write(stop_w, b"x")
        watcher.join()
        os.close(stop_r)
        os.close(stop_w)


def _keep_preload_finalizers_from_exit() -> None:
    """The preload's ``weakref.finalize`` hooks (torch unregisters its operator libraries) do not
    run when a rank exits: like the preload's objects, they are the starter's, not the rank's."""
    import weakref

    for finalizer in list(getattr(weakref.finalize, "_registry", {})):
        finalizer.atexit = False


def _end_children(children: set[int]) -> None:
    """The caller is gone: each fork ends with its own lifeline first (a rank keeps what its pipes
    still hold in its log, worker/entry.py); what is left after CALLER_GONE_GRACE_S is killed
    (a rank that had not yet watched its lifeline, a store host)."""
    deadline = time.monotonic() + CALLER_GONE_GRACE_S
    while children and time.monotonic() < deadline:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.02)
        else:
            children.discard(pid)
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass


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
    request: dict[str, Any],
    fds: list[int],
    sock: socket.socket,
    wake_r: int,
    wake_w: int,
    preloaded: frozenset[str],
) -> NoReturn:
    try:
        _take_over_process(request, fds, sock, wake_r, wake_w)
    except BaseException:  # noqa: BLE001 - a rank that cannot start says why on its stderr
        try:
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(1)
    from air_magic.worker.entry import run_from_launch_file
    from air_magic.worker.shutdown import end_forked_rank

    try:
        run_from_launch_file(request["call_dir"])
    except SystemExit as exc:  # how every rank ends; the frames of the call are gone after this
        code = exc.code
    except BaseException:  # noqa: BLE001 - as an uncaught exception ends a fresh interpreter
        traceback.print_exc()
        code = 1
    end_forked_rank(code, preloaded)


def _become_store_host(
    request: dict[str, Any], fds: list[int], sock: socket.socket, wake_r: int, wake_w: int
) -> NoReturn:
    """Host a call's rendezvous store (node/rendezvous.py) until the caller's lifeline ends.

    The caller bound the listening socket; this fork already has torch, so the caller never
    imports it for the store. ``fds``: the listening socket, the lifeline's read end, and the
    pipe on which "ok" says the store is up (its EOF without it: it could not be made).
    """
    code = 1
    try:
        listener, lifeline_r, ready_w = fds
        _leave_starter(sock, wake_r, wake_w, signal.SIG_IGN)  # the caller ends it, by its lifeline
        from air_magic.node.rendezvous import tcp_store_server

        store = tcp_store_server(
            request["host"], request["port"], request["world_size"], request["timeout_s"], listener
        )
        os.write(ready_w, b"ok")
        os.close(ready_w)
        while os.read(lifeline_r, 4096):  # nothing is written: EOF when the caller closes it, or dies
            pass
        code = 0  # the store's server thread and sockets end with the process
        del store
    except BaseException:  # noqa: BLE001 - said in the starter's log; the caller hosts the store itself
        traceback.print_exc()
        sys.stderr.flush()
    os._exit(code)


def _leave_starter(sock: socket.socket, wake_r: int, wake_w: int, on_sigint: Any) -> None:
    """What every fork of the starter does first: a session of its own (a rank's teardown signals
    its group), default signal handling, none of the starter's descriptors."""
    os.setsid()
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, on_sigint)
    sock.close()
    os.close(wake_r)
    os.close(wake_w)


def _take_over_process(
    request: dict[str, Any], fds: list[int], sock: socket.socket, wake_r: int, wake_w: int
) -> None:
    """Turn this fork of the starter into the process a fresh rank would be."""
    # A fresh interpreter raises KeyboardInterrupt on SIGINT, unless it was started with
    # SIGINT ignored (exec keeps an ignored signal ignored): the caller says which.
    ignored = request.get("sigint_ignored", False)
    _leave_starter(sock, wake_r, wake_w, signal.SIG_IGN if ignored else signal.default_int_handler)
    out_w, err_w, lifeline_r, *output_r = fds
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    for fd in (devnull, out_w, err_w):
        os.close(fd)
    # Unbuffered text streams on the new fds, as `python -u` would give, with the starter's
    # own (a fresh interpreter's) encodings; the __std*__ originals too, so that nothing
    # written through them waits in a buffer. stdout is the one a fresh rank gets too
    # (worker/live_stdout.py: buffered only while the rank floods it).
    sys.stdout = sys.__stdout__ = live_stdout.make_stdout(sys.stdout)  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = _unbuffered_like(sys.stderr, 2)  # type: ignore[misc]
    env = dict(request["env"])
    env[env_names.LIFELINE_FD] = str(lifeline_r)
    env[env_names.OUTPUT_FDS] = ",".join(map(str, output_r))
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    if "umask" in request:
        os.umask(request["umask"])
    _fresh_state(env)


def _unbuffered_like(stream: Any, fd: int) -> io.TextIOWrapper:
    return io.TextIOWrapper(
        io.FileIO(fd, "w", closefd=False),
        encoding=stream.encoding,
        errors=stream.errors,
        write_through=True,
        line_buffering=False,  # what `-u` gives a fresh interpreter (Python/pylifecycle.c, create_stdio)
    )


def _fresh_state(env: dict[str, str]) -> None:
    """What a fresh interpreter would have differently from a fork of the starter.

    Every random source a fresh process seeds from the OS is reseeded here, so no
    two ranks, in one call or across calls, share a sequence. CUDA's generators
    are not touched: the starter never initialised CUDA, so a rank creates them
    (with CUDA's fixed default seed) exactly as a fresh process does.
    """
    import importlib
    import random

    random.seed()  # a fresh process seeds from the OS; a fork would repeat the starter's sequence
    numpy_random = sys.modules.get("numpy.random")  # only if loaded: a fresh process has not either
    if numpy_random is not None:
        numpy_random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()  # the CPU generator: a fresh `import torch` seeds it from the OS
        if env.get("OMP_NUM_THREADS", "").isdigit():
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # read at import, before the fork
    # The starter's import caches may predate files created since (a module the caller just wrote).
    importlib.invalidate_caches()
