"""A persistent session's rank (SPEC §15): set up once, then run cell after cell until told to stop.

The session starts its ranks like any call (``backends/local``: fresh or forked,
torchrun's variables, the lifeline, the rank's pipes); the call's function is
:func:`serve`. It initialises torch's process group and binds the rank's device
once (when torch is installed), then waits on its command pipe
(``wire.session_fifo(..., 'cmd', rank)``) for the number of the next cell. A
cell's payload is a file in the call folder, like a call's; the rank runs it in
the globals it keeps between cells (a ``%%distributed`` cell) or calls it (a
function), writes ``cell-N-result-R.pkl`` or ``cell-N-error-R.pkl``, flushes its
output, and only then answers on its reply pipe: whoever reads the answer has
all the cell's output before it.

In a session ``torch.distributed.init_process_group`` returns at once when the
session's group is up (code written for one-off calls runs unchanged, cell
after cell) and ``destroy_process_group()`` of the default group waits for the
session's end.

SIGINT interrupts the cell running (``KeyboardInterrupt`` in it, reported like
any exception); between cells it is ignored, so an interrupt that comes just
after a cell finished cannot end the rank. The caller writes each interrupt on
the command pipe before its SIGINT: a rank that had not started the cell yet (a
loaded machine) finds it there as it starts the cell, and stops at once.
"""

from __future__ import annotations

import importlib.util
import json
import linecache
import os
import select
import signal
import sys
import warnings
from typing import Any

import psutil

from air_magic.protocol import env_names, serialization, wire
from air_magic.worker import cell_runner, entry, frameworks, live_stdout, main_module

# The rank's globals for cells, kept from one cell to the next: the __dict__ of the session's
# __main__ module (worker/main_module.py), made when the session starts.
_namespace: dict[str, Any] = {}
_torch_group = False  # this session set up torch's default process group (and ends it)
_original_destroy: Any = None


def serve() -> None:
    """The session rank's whole life: set up, answer 'ready', run cells, end when told to stop."""
    rank = int(os.environ["RANK"])
    call_dir = os.environ[env_names.RUN_DIR]
    # The caller holds both ends of both pipes open: neither open blocks.
    commands = _Commands(os.open(wire.session_fifo(call_dir, "cmd", rank), os.O_RDONLY))
    replies = os.open(wire.session_fifo(call_dir, "reply", rank), os.O_WRONLY)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    global _namespace
    _namespace = main_module.fresh_main()
    _set_up_torch()
    _answer(replies, {"ready": True, "memory": memory_in_use()})
    try:
        while True:
            message = commands.next()
            if message is None or message.get("stop"):  # no end of file while the caller lives
                return
            if "interrupt" in message:  # of a cell this rank had finished when it came
                continue
            cell = int(message["cell"])
            ok = _run_cell(call_dir, rank, cell, commands)
            _answer(replies, {"cell": cell, "ok": ok, "memory": memory_in_use()})
    finally:
        _end_torch()


class _Commands:
    """The rank's command pipe: the caller's messages, one JSON line each, in order."""

    def __init__(self, fd: int):
        self._fd = fd
        self._partial = b""
        self._messages: list[dict[str, Any]] = []

    def next(self) -> dict[str, Any] | None:
        """The next message, waiting for it; None at the end of the pipe."""
        while not self._messages:
            if not self._take(os.read(self._fd, 4096)):
                return None
        return self._messages.pop(0)

    def interrupted(self, cell: int) -> bool:
        """Whether the caller interrupted ``cell`` already (not waiting): it wrote so before its
        SIGINT, which this rank ignored if it came before the cell began here."""
        while select.select([self._fd], [], [], 0)[0] and self._take(os.read(self._fd, 4096)):
            pass
        found = any(m.get("interrupt") == cell for m in self._messages)
        self._messages = [m for m in self._messages if "interrupt" not in m]  # older ones: cells gone
        return found

    def _take(self, chunk: bytes) -> bool:
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        self._messages.extend(json.loads(line) for line in lines)
        return bool(chunk)


class _CellFiles:
    """The transport for one cell's outcome (the error record's shape is a call's)."""

    def __init__(self, call_dir: str, rank: int, cell: int):
        self.call_dir, self.rank, self.cell = call_dir, rank, cell

    def write_result(self, data: bytes) -> None:
        wire.write_atomically(wire.cell_result_path(self.call_dir, self.cell, self.rank), data)

    def write_error(self, data: bytes) -> None:
        wire.write_atomically(wire.cell_error_path(self.call_dir, self.cell, self.rank), data)


def _run_cell(call_dir: str, rank: int, cell: int, commands: _Commands) -> bool:
    files = _CellFiles(call_dir, rank, cell)
    frameworks.new_cell()
    stage = "load"
    # SIGINT raises KeyboardInterrupt from here to the cell's end (Python's own handler: no frame of
    # ours in the traceback), loading included; outside a cell it is ignored, so one that comes as a
    # cell ends cannot end the rank. One that came before this cell began here was ignored too: its
    # line on the command pipe says so. While the pipe is read, a SIGINT is only noted (a
    # KeyboardInterrupt then could lose a message read but not yet kept); it raises just after.
    came: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        missed = commands.interrupted(cell)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if missed or came:
            raise KeyboardInterrupt
        data = wire.read_bytes(wire.session_cell_path(call_dir, cell))
        if data is None:
            raise FileNotFoundError(f"cell {cell}'s payload is missing from {call_dir}")
        payload, caller = serialization.loads(data)
        del data
        follow_the_caller(caller)
        known = main_module.rebuilt_so_far()
        fn, args, kwargs, sources = serialization.loads(payload)
        del payload
        for name, lines in sources.items():
            linecache.cache[name] = (sum(map(len, lines)), None, lines, name)
        main_module.adopt(fn, args, kwargs, _namespace, known)
        if fn is cell_runner.run_cell:
            kwargs = {**kwargs, "namespace": _namespace}
        stage = "run"
        try:
            result = fn(*args, **kwargs)
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        stage = "result"
        out = entry._dump_result(result, rank)
        stage = "write"
        files.write_result(out)
        return True
    except BaseException as exc:  # noqa: BLE001 - every failure is reported; the rank lives on
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        entry._report(files, stage, exc)  # type: ignore[arg-type]
        return False
    finally:
        live_stdout.flush()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a stream the cell closed or replaced
                pass


def follow_the_caller(caller: dict[str, Any]) -> None:
    """Before a cell: the notebook's folder, ``sys.path`` and environment changes (``%cd``,
    ``os.environ[...] = ``, ``sys.path.append``), as a one-off call's fresh ranks would start."""
    cwd = caller.get("cwd")
    if cwd and os.path.isdir(cwd):  # on another node of a cluster it may not exist: left as it is
        os.chdir(cwd)
    if caller.get("sys_path"):
        # The notebook's first, then what this rank had beside them (on a Ray node: the paths its
        # agent added, runtime_env's working_dir and py_modules).
        theirs = list(caller["sys_path"])
        sys.path[:] = theirs + [p for p in sys.path if p not in theirs]
    for name, value in caller.get("env", {}).items():
        if not env_names.kept_by_the_ranks(name):
            os.environ[name] = value
    for name in caller.get("unset", []):
        if not env_names.kept_by_the_ranks(name):
            os.environ.pop(name, None)


def _answer(fd: int, message: dict[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    os.write(fd, data)  # shorter than PIPE_BUF: written whole, or not at all


def memory_in_use() -> dict[str, int]:
    """What the rank holds: the CUDA memory torch allocated and reserved, else its resident memory."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return {
                "gpu": int(torch.cuda.memory_allocated()),
                "gpu_reserved": int(torch.cuda.memory_reserved()),
                "device": int(torch.cuda.current_device()),
            }
    except Exception:  # noqa: BLE001 - a broken CUDA context: say what the process holds
        pass
    return {"rss": int(psutil.Process().memory_info().rss)}


def _set_up_torch() -> None:
    """torch's process group and the rank's device, once for the session (nothing without torch)."""
    global _torch_group, _original_destroy
    if importlib.util.find_spec("torch") is None:
        return
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from air_magic.worker.torch_helpers import init_process_group

    if not dist.is_available():
        return
    init_process_group()
    _torch_group = True
    original_init, _original_destroy = c10d.init_process_group, c10d.destroy_process_group

    def init_once(*args: Any, **kwargs: Any) -> None:
        """In a session: the session's group is up already; a second set-up would fail."""
        if dist.is_initialized():
            asked = args[0] if args else kwargs.get("backend")
            timeout = args[2] if len(args) > 2 else kwargs.get("timeout")
            say_what_is_kept(asked, timeout, stacklevel=2)
            return None
        return original_init(*args, **kwargs)

    def destroy_at_the_end(group: Any = None) -> None:
        """In a session: the default group lives until the session ends; other groups end now."""
        if group is None or group is c10d.GroupMember.WORLD:
            return None
        return _original_destroy(group)

    for module in (dist, c10d):
        module.init_process_group = init_once  # type: ignore[attr-defined]
        module.destroy_process_group = destroy_at_the_end  # type: ignore[attr-defined]


def say_what_is_kept(asked: Any, timeout: Any, stacklevel: int) -> None:
    """In a session, warn when a cell asks for a group unlike the session's: it gets the session's.

    ``stacklevel`` counts from the caller of this function (the cell's call is the usual target)."""
    if not _torch_group:
        return
    import torch.distributed as dist

    backend = str(dist.get_backend())
    differs = []
    # 'gloo', 'cpu:gloo,cuda:nccl': the same when they name the session's backends, devices aside
    if asked is not None and _backend_names(str(asked)) != _backend_names(backend):
        differs.append(f"backend={asked!r}")
    if timeout is not None:
        differs.append("timeout")
    if differs:
        warnings.warn(
            f"init_process_group({', '.join(differs)}) kept the session's process group "
            f"(backend {backend!r}, torch's default timeout, set up when the session started); "
            "a one-off call, outside the session, sets up the group its code asks for.",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )


def _backend_names(spec: str) -> set[str]:
    return {part.split(":")[-1].strip() for part in spec.lower().split(",")}


def _end_torch() -> None:
    if not _torch_group or _original_destroy is None:
        return
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            _original_destroy()
    except Exception:  # noqa: BLE001 - the rank is ending anyway
        pass
