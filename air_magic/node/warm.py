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

Preloaded modules: ``AIR_MAGIC_PRELOAD`` (comma-separated), default ``torch``, and,
when the call that starts the starter is tracked, what a rank imports when it logs to
MLflow (:func:`tracking_preload`): ``mlflow`` and, for a database store (the embedded
one is sqlite), its SQLAlchemy store, 2-3 s a rank otherwise. Those extras are not part
of the starter's identity: an untracked call uses a starter that has them, and a
tracked call one that lacks them (its ranks import mlflow themselves), neither rebuilds.

**Start-up variables.** Some variables act only when a process starts
(``PYTHONHASHSEED``, ``PYTHONWARNINGS``, ``PYTHONMALLOC``, ``LD_PRELOAD``,
``MALLOC_*``, the locale, torch's and OpenMP's import-time settings; see
:func:`is_startup_variable`). A fork can only inherit them, so the starter is
started with the start-up variables of the call it serves, and a call whose
ranks would start with others (``env=``, or the caller's environment changed)
rebuilds it first, saying so in one line.

**A starter that does not come up.** A call waits for the starter at most
until the call's own timeout, and a starter gets ``AIR_MAGIC_STARTER_WAIT``
seconds (default 60) in all to become ready; past that it is dropped and
calls start fresh ranks (said once) until ``restart()``.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from air_magic import paths, private_files  # starter.log: 0600, never through a planted link
from air_magic.errors import ConfigurationError
from air_magic.process_tree import stop_trees
from air_magic.protocol import env_names

_BOOTSTRAP = (
    "import json,sys;sys.path[:]=json.loads(sys.argv[3]);"
    "from air_magic.node.starter_main import main;main(int(sys.argv[1]),json.loads(sys.argv[2]))"
)
_lock = threading.Lock()
_starter: Starter | None = None
# A ready starter reads the EOF at once, kills its forks and exits in milliseconds; seconds
# mean it is stuck (in a rank's fork, say), and then it is killed.
STARTER_EXIT_S = 10.0
SPAWN_ANSWER_S = 30.0
# torch imports in 2-5 s, and in a minute on a cold disk of a busy machine: past that, a preload hangs.
STARTER_WAIT_S = 60.0
_MAX_MESSAGE = 1 << 20  # starter messages are small JSON (a pid, an exit code): 1 MiB is never reached


def enabled() -> bool:
    return os.environ.get(env_names.WARM, "1") not in ("0", "false", "no", "off")


def preload_list() -> list[str]:
    raw = os.environ.get(env_names.PRELOAD)
    names = [n.strip() for n in raw.split(",")] if raw is not None else ["torch"]
    return [n for n in names if n and importlib.util.find_spec(n.split(".")[0]) is not None]


_DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
_last_extras: list[str] = []  # what the last prestart asked for: a rebuild elsewhere keeps it


def tracking_preload() -> list[str]:
    """What a tracked call's ranks import as they log: mlflow, and the store its URI names.

    Measured (benchmarks/seed_as_pasted.py, docs/benchmarks.md): a rank's ``import mlflow``
    takes about 1.1 s and its first ``log_metric`` 1.3 s more, most of it importing the
    SQLAlchemy store; in the starter, both overlap the caller's own MLflow start-up. The
    URI is judged from ``MLFLOW_TRACKING_URI`` only (unset: the embedded sqlite store),
    never by importing mlflow here. An explicit ``AIR_MAGIC_PRELOAD`` is the whole list.
    """
    if os.environ.get(env_names.PRELOAD) is not None or importlib.util.find_spec("mlflow") is None:
        return []
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    scheme = uri.split(":", 1)[0].split("+", 1)[0] if ":" in uri else ""
    if not uri or scheme in _DATABASE_SCHEMES:
        return ["mlflow", "mlflow.store.tracking.sqlalchemy_store"]
    return ["mlflow"]


# Variables read when an interpreter (or torch, OpenMP, the C library) starts: a fork
# cannot change them. Prefixes, then whole names; then exceptions that are read later
# (each time they are used, or by the rank itself) or that air_magic sets per rank.
_STARTUP_PREFIXES = (
    *("PYTHON", "LD_", "MALLOC_", "GLIBC_", "TORCH_", "PYTORCH_"),
    *("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "LC_"),
)
# MLflow's two read when it is imported, which a tracked call's starter does (tracking_preload).
_STARTUP_NAMES = frozenset({"LANG", "LANGUAGE", "TZ", "MLFLOW_CONFIGURE_LOGGING", "MLFLOW_LOGGING_LEVEL"})
_LATER_PREFIXES = ("TORCH_NCCL_", "TORCH_DISTRIBUTED_", "TORCHELASTIC_")
_LATER_NAMES = frozenset(
    {
        "PYTHONUNBUFFERED",  # given to every rank; the fork gets unbuffered streams (starter_main)
        "PYTHONPATH",  # ranks take the caller's sys.path from launch.json, fresh or forked
        "PYTHONBREAKPOINT",  # read at each breakpoint()
        "PYTHONSTARTUP",  # interactive sessions only
        "PYTHONINSPECT",
        "OMP_NUM_THREADS",  # applied in each fork (torch.set_num_threads)
        # Read at each torch.cuda.is_available(), and set by Lightning's import in the kernel: a
        # variable the kernel's own imports set must not restart the starter (26 s instead of ~1 s).
        "PYTORCH_NVML_BASED_CUDA_CHECK",
    }
)


def is_startup_variable(name: str) -> bool:
    if name in _LATER_NAMES or name.startswith(_LATER_PREFIXES):
        return False
    return name in _STARTUP_NAMES or name.startswith(_STARTUP_PREFIXES)


def startup_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The part of a rank's environment that acts only when its process starts."""
    return {k: v for k, v in env.items() if is_startup_variable(k)}


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

    def __init__(
        self,
        preload: list[str],
        log_path: str | None = None,
        startup_env: Mapping[str, str] | None = None,
        extra_preload: list[str] | None = None,
    ):
        self.preload = preload
        self.fingerprint = fingerprint(preload)  # the extras (tracking_preload) are not part of it
        self.extra_preload = [n for n in extra_preload or [] if n not in preload]
        self.startup_env = dict(startup_environment(os.environ) if startup_env is None else startup_env)
        self.log_path = log_path
        self.started_at = time.monotonic()
        # The caller's environment, with exactly the start-up variables the ranks will have.
        env = {k: v for k, v in os.environ.items() if not is_startup_variable(k)}
        env.update(self.startup_env)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        out = open(log_path, "ab", opener=private_files.opener) if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed below
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _BOOTSTRAP,
                    str(child.fileno()),
                    json.dumps(preload + self.extra_preload),
                    json.dumps(sys.path),
                ],
                pass_fds=(child.fileno(),),
                env=env,
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
        self.users = 0  # calls whose ranks it forked and which are still running (hold/release)
        self.awaited_at = float("-inf")  # when a call last waited for it (get_starter with a wait)
        self._lock = threading.Lock()

    def fileno(self) -> int:
        return self.sock.fileno()

    def waited_s(self) -> float:
        return time.monotonic() - self.started_at

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

    def spawn(self, env: dict[str, str], cwd: str, call_dir: str, fds: list[int]) -> int:
        """Fork a rank (``fds``: its stdout and stderr pipes, the lifeline's read end); its pid."""
        request = {
            "op": "spawn",
            "env": env,
            "cwd": cwd,
            "call_dir": call_dir,
            "umask": _current_umask(),
            "sigint_ignored": sigint_ignored(),
        }
        return self._fork(request, fds)

    def host_store(self, host: str, port: int, world_size: int, timeout_s: float, fds: list[int]) -> int:
        """Fork the host of a rendezvous store (``fds``: its listening socket, its lifeline's read
        end, its ready pipe; starter_main._become_store_host); its pid."""
        where = {"host": host, "port": port, "world_size": world_size, "timeout_s": timeout_s}
        return self._fork({"op": "store", **where}, fds)

    def _fork(self, request: dict[str, Any], fds: list[int]) -> int:
        with self._lock:
            if self.broken:
                raise OSError("the warm starter was closed")
            try:
                return self._answer_to(request, fds)
            except BaseException:
                # Sent but not answered (a Ctrl-C in the wait): its answer would be read as the
                # next request's. Broken: the next call gets a new starter.
                self.broken = True
                raise

    def _answer_to(self, request: dict[str, Any], fds: list[int]) -> int:
        socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
        # A ready starter forks in milliseconds; one that takes this long is stuck, and the
        # rank starts fresh instead (the caller's thread must not hang on a broken starter).
        deadline = time.monotonic() + SPAWN_ANSWER_S
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
        if self.sock.fileno() < 0:  # closed under us (the interpreter exiting, say)
            self.broken = True
            return None
        try:
            waiter = select.poll()  # not select(): a caller with 1,024 files open numbers past it
            waiter.register(self.sock, select.POLLIN)
            ready = waiter.poll(max(0.0, timeout) * 1000)
        except (OSError, ValueError):
            self.broken = True
            return None
        if not ready:
            return None
        try:
            data = self.sock.recv(_MAX_MESSAGE)
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
            _refused(self, str(message["error"]))
            return None
        return message

    def alive(self) -> bool:
        return not self.broken and self.proc.poll() is None

    def close(self) -> None:
        was_ready, self.broken = self.ready, True
        self.sock.close()  # EOF: the starter kills what it started and exits
        # Still importing (or stuck there), it would not read the EOF soon: no grace then.
        stop_trees([self.proc], STARTER_EXIT_S if was_ready else 0, ask=None)


def starter_wait_s() -> float:
    """How long a starter may take, in all, to become ready before calls give up on it."""
    try:
        return max(0.0, float(os.environ.get(env_names.STARTER_WAIT, str(STARTER_WAIT_S))))
    except ValueError:
        return STARTER_WAIT_S


_stuck: set[str] = set()  # fingerprints of starters that never became ready: go cold until restart()


def prestart(
    log_root: str | None = None, env: Mapping[str, str] | None = None, tracked: bool = False
) -> None:
    """Make sure a starter is on its way, without waiting for it.

    ``env`` is the call's extra environment: its start-up variables go to the starter.
    ``tracked``: the call records an MLflow run, so a new starter also preloads
    :func:`tracking_preload`.
    """
    global _last_extras
    if enabled():
        _last_extras = tracking_preload() if tracked else []
        get_starter(log_root, startup_environment({**os.environ, **(env or {})}), extra_preload=_last_extras)


def get_starter(
    log_root: str | None = None,
    startup_env: Mapping[str, str] | None = None,
    wait_s: float = 0.0,
    hold: bool = False,
    extra_preload: list[str] | None = None,
) -> Starter | None:
    """The ready starter for ranks with these start-up variables (waiting up to ``wait_s``), or None.

    Starts one if needed; rebuilds one whose start-up variables differ (said in one line),
    unless another call is waiting for that one to become ready (this call then gets None: fresh
    ranks, rather than two calls closing each other's starter in turn). Returns None when warm
    start is off, when the starter is not ready within ``wait_s``, or when it has used up its
    :func:`starter_wait_s` (it is then dropped, said once). ``hold``: the starter returned
    counts this call as a user (:func:`release` ends that) before anyone else can close it.
    """
    global _starter
    if not enabled():
        return None
    preload = preload_list()
    wanted = dict(startup_environment(os.environ) if startup_env is None else startup_env)
    fp = fingerprint(preload)
    with _lock:
        if _starter is not None:
            _starter.is_ready(0.0)  # a message already sent (a refusal) counts before alive() is asked
        if _starter is not None and (not _starter.alive() or _starter.fingerprint != fp):
            _retire(_starter)
            _starter = None
    if fp in _stuck:
        return None
    with _lock:
        if _starter is not None and (not _starter.alive() or _starter.fingerprint != fp):
            _retire(_starter)
            _starter = None
        if _starter is not None and _starter.startup_env != wanted:
            if time.monotonic() - _starter.awaited_at < AWAITED_S and not _starter.is_ready():
                return None  # another call waits for it to become ready: not closed under it
            _say_rebuild(_starter.startup_env, wanted)
            _retire(_starter)
            _starter = None
        if _starter is None:
            try:
                extras = _last_extras if extra_preload is None else extra_preload
                _starter = Starter(preload, _starter_log(log_root), wanted, extras)
            except (OSError, ConfigurationError):
                # The log folder cannot be written: the call's own log folder will say so
                # clearly (output.make_log_dir); this call simply starts fresh ranks.
                return None
        starter = _starter
        if wait_s > 0:
            starter.awaited_at = time.monotonic()
    budget = starter_wait_s() - starter.waited_s()
    if starter.is_ready(max(0.0, min(wait_s, budget))):
        if not hold:
            return starter
        with _lock:  # held before anyone else can retire it (and only if nobody did meanwhile)
            if starter is _starter and starter.alive():
                starter.users += 1
                return starter
        return None
    if starter.waited_s() >= starter_wait_s() and not starter.is_ready():
        _give_up(starter)
    return None


AWAITED_S = 2.0  # a starter a call waited for this recently is not rebuilt for another call's variables


def ready_for(startup_env: Mapping[str, str]) -> bool:
    """The current starter is alive and ready for ranks with these start-up variables."""
    starter = _starter
    return (
        starter is not None
        and starter.startup_env == dict(startup_env)
        and starter.alive()
        and starter.is_ready()
    )


def starting() -> Starter | None:
    """The starter that is on its way but not ready yet, if any."""
    starter = _starter
    if starter is None or not starter.alive() or starter.is_ready():
        return None
    return starter


def _starter_log(log_root: str | None) -> str:
    root = log_root or paths.default_log_root()
    os.makedirs(root, mode=0o700, exist_ok=True)
    return os.path.join(root, paths.STARTER_LOG)


def _say_rebuild(old: Mapping[str, str], new: Mapping[str, str]) -> None:
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
    print(
        f"air_magic: restarting the warm starter: {shown} differ from its start-up environment "
        "(they act only when a process starts, so ranks need a starter started with them)",
        file=sys.stderr,
    )


def _give_up(starter: Starter) -> None:
    global _starter
    with _lock:
        _stuck.add(starter.fingerprint)
        if _starter is starter:
            _starter = None
    starter.close()
    print(
        f"air_magic: the warm starter did not become ready in {starter_wait_s():g} s "
        f"(its log: {starter.log_path}); calls start fresh ranks until %distributed restart "
        "(or air_magic.restart_warm_start()). AIR_MAGIC_STARTER_WAIT sets the wait.",
        file=sys.stderr,
    )


def _refused(starter: Starter, why: str) -> None:
    """The starter cannot serve forks (its preload made them unusable): fresh ranks until restart().
    No lock: this runs inside the starter's own (its message is being read); the next
    get_starter() retires the broken starter and, its preload now stuck, builds no other."""
    _stuck.add(starter.fingerprint)
    print(f"air_magic: {why}.", file=sys.stderr)


def _current_umask() -> int:
    """The caller's umask, read without changing it (os.umask would, for a moment, in every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def sigint_ignored() -> bool:
    """This process ignores SIGINT (a script started with ``&``): so will the ranks it starts."""
    try:
        return signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    except ValueError:
        return False


_exiting = False


@atexit.register
def at_exit() -> None:
    """At interpreter exit: calls still running (in daemon threads) are stopping; the starter goes."""
    global _exiting
    _exiting = True  # a call still running in a daemon thread is being stopped, not failing
    restart(force=True)


def process_exiting() -> bool:
    """True once this process has begun to exit (its warm starter, and the ranks it forked, are gone)."""
    return _exiting


def restart(force: bool = False) -> None:
    """Stop the starter; the next call starts a fresh one (after installing packages, say).

    A starter whose forks still run a call (a background run) is stopped when that call
    ends, unless ``force`` (the process is exiting: everything goes now).
    """
    global _starter
    with _lock:
        _stuck.clear()
        if force:
            for old in _retired:
                old.close()
            _retired.clear()
            if _starter is not None:
                _starter.close()
        elif _starter is not None:
            _retire(_starter)
        _starter = None


_retired: list[Starter] = []  # replaced while a call still ran on its forks; closed by release()


def _retire(starter: Starter) -> None:
    """Close a starter that is being replaced, or, while its forks run a call, once they are done.

    Closing a starter kills what it forked: a background run's ranks must not go with it.
    Called with ``_lock`` held.
    """
    # Still running (even if broken): what it forked for a running call (ranks, the call's
    # rendezvous store) stays until that call releases it.
    if starter.users > 0 and starter.proc.poll() is None:
        _retired.append(starter)
    else:
        starter.close()


def serves(startup_env: Mapping[str, str]) -> bool:
    """The current starter is for ranks with these start-up variables (ready or still importing)."""
    starter = _starter
    return starter is not None and starter.startup_env == dict(startup_env)


def release(starter: Starter) -> None:
    """The call that held ``starter`` (``get_starter(hold=True)``) is over, every rank reaped;
    a starter retired meanwhile goes now."""
    with _lock:
        starter.users -= 1
        if starter.users <= 0 and starter in _retired:
            _retired.remove(starter)
            starter.close()


def starter_pid() -> int | None:
    return _starter.proc.pid if _starter is not None and _starter.alive() else None
