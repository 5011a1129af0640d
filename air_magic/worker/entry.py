"""What runs inside each rank process: load the payload, call the function, report.

:func:`main` runs a payload from a transport it is handed
(:class:`~air_magic.protocol.wire.RankTransport`): the local backend's is the
call folder (:class:`~air_magic.protocol.wire.CallFolder`); a remote agent can
hand it another. The local backend starts ``sys.executable -c BOOTSTRAP
<call_dir>`` (or forks the warm starter, which calls :func:`run_from_launch_file`);
the bootstrap restores the caller's ``sys.path`` and runs the rank. This module
imports only the standard library, cloudpickle and air_magic's protocol: never
IPython, ipywidgets or torch (the user's function imports what it needs).

A rank either writes ``result-<rank>.pkl`` and exits 0, or writes
``error-<rank>.pkl`` and exits 1. Anything else (a signal, ``os._exit``) is
noticed by its rank group, which holds the process handle. Once it has read the
payload it leaves a ``loaded-<rank>`` mark, so its rank group can delete the
payload (the arguments in clear) as soon as every rank has it.

A rank ends the way a Python process ends, fresh or forked: ``SystemExit``
and the interpreter's own shutdown, which joins non-daemon threads, runs
``atexit`` hooks and flushes files the user left open. Only then does
:func:`_end_of_rank` (an ``atexit`` hook registered before any other) kill
what the rank left running.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import linecache
import logging
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from typing import Any, NoReturn

# Every rank needs psutil as it exits (_kill_descendants): imported here, it is preloaded in the
# warm starter (which imports this module first), so a forked rank does not import it at exit (~15 ms).
import psutil

from air_magic.protocol import env_names, serialization, wire
from air_magic.protocol.stacks import STACKS_SIGNAL, stacks_path
from air_magic.worker import cell_runner, frameworks, live_stdout, main_module, targets
from air_magic.worker import metrics as rank_metrics
from air_magic.worker import mlflow_hook as rank_mlflow

# The rank group passes this to ``python -c``; argv[1] is the run directory.
# Only enough to find air_magic on the caller's sys.path; run_from_launch_file does the rest.
BOOTSTRAP = (
    "import json,sys;d=sys.argv[1];sys.path[:]=json.load(open(d+'/launch.json'))['sys_path'];"
    "from air_magic.worker.entry import run_from_launch_file;run_from_launch_file(d)"
)


def run_from_launch_file(call_dir: str) -> NoReturn:
    """Take the caller's sys.path and argv from launch.json, then run the rank (fresh or forked)."""
    transport = wire.CallFolder(call_dir, int(os.environ["RANK"]))
    launch = transport.read_launch()
    sys.path[:] = launch["sys_path"]
    sys.argv[:] = launch["argv"]
    main(transport)


def main(transport: wire.RankTransport) -> NoReturn:
    """Run this rank's part of the call: payload in through ``transport``, outcome out through it."""
    global _in_rank
    _in_rank = True
    # As a fresh `python` starts: no signal blocked. A rank started from a thread that blocks some
    # (a Ray agent's) inherits that mask through fork and exec: SIGINT would never interrupt a
    # session's cell, SIGTERM's grace would not run, the stack-dump signal would not answer.
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    install_exit_hook()  # no-op in a forked rank: the starter installed it before its preload
    # A segfault in C code still leaves a Python stack in the rank's log.
    faulthandler.enable(all_threads=True)
    _offer_to_the_oom_killer()
    _answer_stack_requests()
    _watch_lifeline()
    live_stdout.start()  # buffers stdout only while the rank floods it
    _untracked_mlflow_store(transport.rank)
    rank_mlflow.install()  # only a hook: mlflow is patched if and when the rank imports it
    frameworks.install()  # and the frameworks air_magic adapts (worker/frameworks.py)
    rank = transport.rank
    stage = "load"
    try:
        payload = transport.read_payload()
        transport.mark_loaded()
        known = main_module.rebuilt_so_far()
        fn, args, kwargs, sources = serialization.loads(payload)
        del payload
        for name, lines in sources.items():  # notebook cells: tracebacks show their lines
            linecache.cache[name] = (sum(map(len, lines)), None, lines, name)
        # The user's names are attributes of __main__, as under torchrun (worker/main_module.py).
        namespace = main_module.fresh_main()
        main_module.adopt(fn, args, kwargs, namespace, known)
        if fn is cell_runner.run_cell:
            kwargs = {**kwargs, "namespace": namespace}
        stage = "run"
        result = fn(*args, **kwargs)
        stage = "result"
        data = _dump_result(result, rank)
        stage = "write"
        transport.write_result(data)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, even SystemExit
        _report(transport, stage, exc)
        # A script's sys.exit(N) ends its rank with N, as under python or torchrun.
        _exit(exc.exit_status if isinstance(exc, targets.ScriptExit) else 1)
    _exit(0)


def _untracked_mlflow_store(rank: int) -> None:
    """An untracked call's rank: its own MLflow calls go to a sqlite file of its call folder."""
    call_dir = os.environ.get(env_names.RUN_DIR)
    if os.environ.get("MLFLOW_TRACKING_URI") == wire.UNTRACKED_MLFLOW_URI and call_dir:
        os.environ["MLFLOW_TRACKING_URI"] = wire.untracked_mlflow_uri(call_dir, rank)
        # The store's INFO lines as it makes its tables ("Creating initial MLflow database
        # tables..."): ours to make, not the user's to read in every rank's output.
        logging.getLogger("mlflow.store.db.utils").addFilter(lambda record: record.levelno >= logging.WARNING)


def _dump_result(result: Any, rank: int) -> bytes:
    try:
        return serialization.dumps_result(result)
    except Exception as exc:  # noqa: BLE001 - any pickling failure is named below
        from air_magic.errors import PayloadError

        found = serialization.find_unpicklable(result, "return value")
        where, error = found if found is not None else ("return value", exc)
        raise PayloadError(
            f"rank {rank}'s {where} cannot be sent back: {error}. "
            "Return plain data (numbers, tensors, dicts, state_dict()) instead."
        ) from None


def _report(transport: wire.RankTransport, stage: str, exc: BaseException) -> None:
    when = time.monotonic()
    rank = transport.rank
    tb = exc.__traceback__
    if stage == "run":
        # Drop air_magic's own frames (main, the cell runner): the user's frames start below them.
        while tb is not None and tb.tb_next is not None and _is_ours(tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next
    if isinstance(exc, targets.ScriptExit):
        # sys.exit(N) in a script: no traceback (Python prints none; torchrun neither), only the
        # message of sys.exit("message"), which Python prints.
        text = f"{exc.message}\n" if exc.message else ""
    else:
        text = "".join(traceback.format_exception(type(exc), exc, tb))
    record = wire.ErrorRecord.of(exc, rank, when, stage, text)
    unwritten = None
    try:
        transport.write_error(serialization.dumps(record))
    except Exception as write_error:  # noqa: BLE001 - the text still reaches the log, with why
        unwritten = write_error
    # The traceback also goes to the rank's stderr, so the log tells the story on its own,
    # after what the rank printed before it.
    live_stdout.flush()
    sys.stderr.write(text)
    if unwritten is not None:  # last: the caller's message shows a rank's last lines only
        sys.stderr.write(f"{wire.ERROR_RECORD_UNWRITTEN}: {unwritten}\n")


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # air_magic/


def _is_ours(filename: str) -> bool:
    # runpy: how `air-magic run script.py` runs the script (worker/targets.py), not the user's code
    if filename == "<frozen runpy>" or os.path.basename(filename) == "runpy.py":
        return True
    return os.path.abspath(filename).startswith(_PACKAGE_DIR)


_stacks_file: Any = None  # kept open: faulthandler writes to its descriptor when signalled


# When memory runs out, the kernel's OOM killer takes the process with the highest score, mostly
# its size: the notebook's kernel (its data, its CUDA-free caller side) often outweighs one rank,
# and losing it loses the user's session. Measured here: 200 fresh ranks on a 23 GB machine, the
# killer took the caller (154 MB), not a rank. A rank raises its own adjustment (allowed without
# privileges: only lowering needs them), so a rank goes first; the call then reports that rank's
# SIGKILL as the likely OOM cause. Its children (DataLoader workers) inherit it.
RANK_OOM_SCORE_ADJ = 500


def _offer_to_the_oom_killer() -> None:
    try:
        with open("/proc/self/oom_score_adj", "r+") as f:
            if int(f.read() or 0) < RANK_OOM_SCORE_ADJ:
                f.seek(0)
                f.write(str(RANK_OOM_SCORE_ADJ))
    except (OSError, ValueError):  # not Linux, or a sandbox that hides it: nothing to adjust
        pass


def _answer_stack_requests() -> None:
    """Dump every thread's stack to the rank's stacks file on STACKS_SIGNAL (protocol/stacks.py).

    The file is created after the handler is registered: its existence tells the caller
    that the signal is safe to send.
    """
    global _stacks_file
    log_dir = os.environ.get(env_names.LOG_DIR)
    rank = os.environ.get("RANK")
    if not log_dir or rank is None or _stacks_file is not None:
        return
    path = stacks_path(log_dir, int(rank))
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)  # private
        _stacks_file = os.fdopen(fd, "a", buffering=1)
        faulthandler.register(STACKS_SIGNAL, file=_stacks_file, all_threads=True, chain=False)
        os.replace(tmp, path)
    except (OSError, ValueError, RuntimeError):  # no log folder, or no such signal here: py-spy only
        _stacks_file = None


def _watch_lifeline() -> None:
    """Die with the caller: when the rank group's end of the lifeline pipe closes, kill this rank's group.

    The caller holds the pipe's write end; the kernel closes it however the
    caller dies (even SIGKILL), and the read here returns EOF. The rank is a
    process-group leader, so killing the group also takes DataLoader workers
    and other children it started.
    """
    raw = os.environ.get(env_names.LIFELINE_FD)
    if not raw:
        return
    fd = int(raw)
    os.set_inheritable(fd, False)
    output = _own_pipes()

    def watch() -> None:
        wire.wait_for_eof(fd)
        _end_with_the_caller(output)

    threading.Thread(target=watch, name="air_magic-lifeline", daemon=True).start()


# What a rank whose caller died appends to its log: its pipes hold at most 1 MiB each.
_UNREAD_MAX = 4 << 20
# A rank whose caller died is gone within this, whatever its end waits for (see _end_with_the_caller).
_END_WITHIN_S = 3.0


def _own_pipes() -> list[int]:
    """The read ends of this rank's stdout and stderr pipes (kept from the rank's own children)."""
    fds = []
    for text in os.environ.pop(env_names.OUTPUT_FDS, "").split(","):
        with contextlib.suppress(ValueError, OSError):
            fd = int(text)
            os.set_inheritable(fd, False)
            fds.append(fd)
    return fds


def _end_with_the_caller(output: list[int]) -> None:
    """The caller is gone: this rank's group stops, what its pipes hold goes into its log, then the
    group is killed. A fork does it from a group of its own: stopped first, the rank prints nothing
    more that its log would miss (a thread of the rank, draining while the rank prints on, would)."""
    group = os.getpgrp()
    # The kill comes anyway: what follows may wait on a lock that a print into a full pipe holds,
    # which nobody reads any more (the fork's flush); a sleeping thread needs no lock.
    threading.Thread(
        target=_kill_group_after, args=(group,), name="air_magic-lifeline-kill", daemon=True
    ).start()
    if output:
        # Printing through from here on: a line the rank prints before it is stopped is in the
        # pipe, not in a flood's buffer that the stop would keep from it.
        with contextlib.suppress(Exception):
            live_stdout.finish()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Python 3.12's word on fork() in a threaded process
                pid = os.fork()
        except OSError:
            pid = -1
        if pid == 0:  # only system calls from here: the other threads' locks are not ours
            try:
                os.setpgid(0, 0)
                os.killpg(group, signal.SIGSTOP)
                _keep_unread_output(output)
            finally:
                os.killpg(group, signal.SIGKILL)
                os._exit(0)
        if pid > 0:
            time.sleep(60)  # stopped, then killed, by the fork
        _keep_unread_output(output)  # no fork: what is there now
    os.killpg(group, signal.SIGKILL)


def _kill_group_after(group: int) -> None:
    time.sleep(_END_WITHIN_S)
    os.killpg(group, signal.SIGKILL)


def _keep_unread_output(fds: list[int]) -> None:
    """What this rank printed that the caller had not read yet goes to the end of the rank's log."""
    log_dir, rank = os.environ.get(env_names.LOG_DIR), os.environ.get("RANK")
    if not fds or not log_dir or rank is None:
        return
    chunks = []
    for fd in fds:
        with contextlib.suppress(OSError):
            os.set_blocking(fd, False)
            got = 0
            while got < _UNREAD_MAX:
                try:
                    data = os.read(fd, 1 << 20)
                except BlockingIOError:
                    break
                if not data:
                    break
                chunks.append(data)
                got += len(data)
    if not chunks:
        return
    with contextlib.suppress(OSError):
        log = os.open(wire.rank_log_path(log_dir, rank), os.O_WRONLY | os.O_APPEND)
        try:
            os.write(log, b"".join(chunks))
        finally:
            os.close(log)


_in_rank = False  # True in a rank; the starter installs the exit hook too, for its forks
_hook_installed = False


def install_exit_hook() -> None:
    """Register :func:`_end_of_rank` before any other atexit hook, so that it runs after all of them."""
    global _hook_installed
    if not _hook_installed:
        _hook_installed = True
        atexit.register(_end_of_rank)


def _end_of_rank() -> None:
    if _in_rank:
        rank_metrics.report_lost()
        live_stdout.finish()  # after every other atexit hook: what they printed is written too
        _kill_descendants()


def _exit(code: int) -> NoReturn:
    """End like ``python`` does: threads joined, atexit hooks run, open files flushed and closed.

    Why not ``os._exit`` (faster): it drops a checkpoint thread's work, the user's
    atexit hooks and unflushed files. A fresh rank ends with the interpreter's own
    shutdown; a forked rank catches this ``SystemExit`` in the starter's code and
    ends through :func:`air_magic.worker.shutdown.end_forked_rank` (same steps, faster).
    """
    live_stdout.flush()  # the rank's own stdout, even if the user replaced sys.stdout
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - best effort while exiting
            pass
    raise SystemExit(code)


def _kill_descendants() -> None:
    """A rank leaves nothing behind: not even children that left its process group.

    The rank group kills the rank's process group afterwards; this catches ``setsid``
    children, which the group kill cannot reach once the rank is gone.
    """
    try:
        children = psutil.Process().children(recursive=True)
    except Exception:  # noqa: BLE001 - best effort; the rank group's kill still runs
        return
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
