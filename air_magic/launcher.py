"""Where ranks are started and watched: the local launcher backend.

The flow of one call, top to bottom::

    surface (decorator; later the cell magic and CLI)
      -> LaunchRequest: the pickled payload, the accelerator plan, the settings
      -> LocalLauncher.run(request, bus)
           1. private run directory (0700): launch.json + payload.pkl, written once
           2. rendezvous store on 127.0.0.1, port chosen by the kernel (rendezvous.py)
           3. one fresh ``sys.executable`` per rank, each leading its own process
              group, stdout/stderr on pipes, the lifeline pipe's read end inherited
           4. one loop waits on everything at once: output pipes, a pidfd per rank,
              and the deadline; output goes to OutputRouter (logs, events, tails)
           5. the first failure, the timeout or an interrupt stops every rank's tree
              (process_tree.py); failures.py builds the error from the earliest failure
           6. results are read in rank order; the run directory is removed
      -> events (RunStarted, RankStarted, RankOutput, RankExited, RunFinished)
         flow to consumers (text display now; widgets and MLflow later), which
         never drive processes.

Inside a rank, see rank_entry.py.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from air_magic import rank_entry, serialization, warm, wire
from air_magic.accelerators import AcceleratorPlan
from air_magic.errors import DistributedTimeoutError, LaunchError, PayloadError
from air_magic.events import EventBus, RankExited, RankStarted, RankState, RunFinished, RunStarted, Tick
from air_magic.failures import RankFailure, build_exception, exit_words
from air_magic.output import OutputRouter, make_log_dir
from air_magic.process_tree import DEFAULT_GRACE_S, DescendantTracker, stop_trees
from air_magic.rank_env import rank_environment
from air_magic.rendezvous import RendezvousStore

INTERRUPT_GRACE_S = 1.0
TICK_S = 0.2  # how often the loop wakes without output, for displays and the deadline
_DRAIN_S = 2.0
_READ_SIZE = 1 << 16


@dataclass(frozen=True)
class LaunchRequest:
    """Everything a backend needs to run one call."""

    name: str  # the function's (or cell's) name, for display and logs
    payload: bytes  # cloudpickle of (fn, args, kwargs)
    plan: AcceleratorPlan
    timeout: float | None
    env: dict[str, str] = field(default_factory=dict)
    log_root: str | None = None
    grace_s: float = DEFAULT_GRACE_S
    warm: bool = True  # fork ranks from the warm starter when it is ready (warm.py)
    tracking: str | None = None  # for displays: the MLflow run, in words
    tracking_url: str | None = None
    mlflow_run_id: str | None = None


@dataclass
class RunResult:
    """How a run ended: every rank's value in rank order, or the error to raise."""

    run_id: str
    log_dir: str
    outcome: str  # 'succeeded', 'failed' or 'timeout'
    values: list[Any] | None = None
    error: BaseException | None = None

    def unwrap(self) -> list[Any]:
        if self.error is not None:
            # Raised here, the traceback starts at the caller's line, not inside the launcher.
            raise self.error
        assert self.values is not None
        return self.values


def new_run_id() -> str:
    # Timestamp first, so log folders sort by age.
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


class LocalLauncher:
    """Runs every rank as a fresh local process of the caller's interpreter."""

    def run(self, request: LaunchRequest, bus: EventBus) -> RunResult:
        run_id = new_run_id()
        log_dir = make_log_dir(request.log_root, run_id)
        run_dir = tempfile.mkdtemp(prefix=f"air_magic-{run_id}-")  # mode 0700
        try:
            _write_run_files(run_dir, request.payload)
            store = RendezvousStore(request.plan.world_size)
            try:
                return _Run(request, bus, run_id, run_dir, log_dir, store.port).execute()
            finally:
                store.close()
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)


def _write_run_files(run_dir: str, payload: bytes) -> None:
    launch = {"sys_path": [p for p in sys.path], "argv": list(sys.argv) or [""]}
    wire.write_atomically(os.path.join(run_dir, wire.LAUNCH_FILE), json.dumps(launch).encode())
    wire.write_atomically(os.path.join(run_dir, wire.PAYLOAD_FILE), payload)


class _Fresh:
    """A rank started as a fresh ``sys.executable`` (our child: Popen knows its exit code)."""

    def __init__(self, proc: subprocess.Popen[bytes]):
        self.proc = proc
        self.pid = proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)


class _Forked:
    """A rank forked by the warm starter: not our child, so the starter reports its exit code."""

    def __init__(self, pid: int, starter: warm.Starter):
        self.pid = pid
        self.starter = starter
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.starter.poll(self.pid)
            if self.returncode is None and not self.starter.alive() and not _exists(self.pid):
                self.returncode = -signal.SIGKILL  # the starter died with it; nothing else is known
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class _RankProcess:
    def __init__(self, rank: int, proc: _Fresh | _Forked, warm_started: bool):
        self.rank = rank
        self.proc = proc
        self.warm_started = warm_started
        self.pidfd: int | None = None
        try:
            self.pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # old kernel: the loop polls instead
            self.pidfd = None
        self.exit_code: int | None = None
        self.exited_at: float | None = None  # the loop's last time it saw the rank alive
        self.dead_since: float | None = None  # seen gone (pidfd) before its exit code came
        self.state = RankState.STARTING


class _Run:
    """One call's ranks, from start to the last reaped process."""

    def __init__(
        self, request: LaunchRequest, bus: EventBus, run_id: str, run_dir: str, log_dir: str, port: int
    ):
        self.request = request
        self.bus = bus
        self.run_id = run_id
        self.run_dir = run_dir
        self.log_dir = log_dir
        self.port = port
        self.world = request.plan.world_size
        self.ranks: list[_RankProcess] = []
        self.router = OutputRouter(log_dir, self.world, bus)
        self.selector = selectors.DefaultSelector()
        self.tracker = DescendantTracker()
        self.started = time.monotonic()
        self.failed_rank: int | None = None

    # -- the whole call ----------------------------------------------------------------

    def execute(self) -> RunResult:
        plan = self.request.plan
        self.bus.emit(
            RunStarted(
                run_id=self.run_id,
                world_size=self.world,
                backend=plan.backend,
                detected=plan.detected,
                cpu_mode=plan.cpu_mode,
                log_dir=self.log_dir,
                name=self.request.name,
                tracking=self.request.tracking,
                tracking_url=self.request.tracking_url,
                mlflow_run_id=self.request.mlflow_run_id,
            )
        )
        lifeline_r, lifeline_w = os.pipe()
        outcome = "failed"
        error: BaseException | None = None
        try:
            try:
                self._start_ranks(lifeline_r)
            finally:
                os.close(lifeline_r)
            outcome = self._watch()
            if outcome == "succeeded":
                try:
                    return RunResult(self.run_id, self.log_dir, outcome, values=self._results())
                except PayloadError as exc:
                    outcome, error = "failed", exc
            else:
                error = self._error(outcome)
            return RunResult(self.run_id, self.log_dir, outcome, error=error)
        except KeyboardInterrupt:
            outcome = "interrupted"
            self._stop(INTERRUPT_GRACE_S)
            raise
        finally:
            self._stop(self.request.grace_s)  # no-op when every rank is already reaped
            self._drain()
            self.router.close()
            self.selector.close()
            os.close(lifeline_w)  # last: ranks die with the lifeline if anything above failed
            for r in self.ranks:
                if r.pidfd is not None:
                    os.close(r.pidfd)
            self.bus.emit(
                RunFinished(
                    run_id=self.run_id,
                    outcome=outcome,
                    elapsed=time.monotonic() - self.started,
                    log_dir=self.log_dir,
                    error=None if error is None else f"{type(error).__name__}: {error}",
                    failed_rank=self.failed_rank,
                )
            )

    # -- starting ----------------------------------------------------------------------

    def _start_ranks(self, lifeline_r: int) -> None:
        cwd = os.getcwd()
        starter = warm.get_starter(wait_s=warm.STARTER_WAIT_S) if self.request.warm else None
        if starter is not None:
            # Its exit reports wake the loop as soon as they come.
            self.selector.register(starter, selectors.EVENT_READ, ("starter", None))
        for rank in range(self.world):
            env = rank_environment(
                rank=rank,
                plan=self.request.plan,
                port=self.port,
                run_id=self.run_id,
                run_dir=self.run_dir,
                log_dir=self.log_dir,
                lifeline_fd=lifeline_r,
                extra=self.request.env,
            )
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            try:
                proc = self._spawn(starter, env, cwd, out_w, err_w, lifeline_r)
            except OSError as exc:
                for fd in (out_r, err_r):
                    os.close(fd)
                raise LaunchError(f"could not start rank {rank} with {sys.executable}: {exc}") from exc
            finally:
                os.close(out_w)
                os.close(err_w)
            ranked = _RankProcess(rank, proc, isinstance(proc, _Forked))
            self.ranks.append(ranked)
            for stream, fd in (("stdout", out_r), ("stderr", err_r)):
                os.set_blocking(fd, False)
                self.selector.register(fd, selectors.EVENT_READ, (ranked, stream))
            if ranked.pidfd is not None:
                self.selector.register(ranked.pidfd, selectors.EVENT_READ, (ranked, None))
            ranked.state = RankState.RUNNING
            self.bus.emit(RankStarted(rank=rank, pid=proc.pid))

    def _spawn(
        self,
        starter: warm.Starter | None,
        env: dict[str, str],
        cwd: str,
        out_w: int,
        err_w: int,
        lifeline_r: int,
    ) -> _Fresh | _Forked:
        if starter is not None:
            try:
                return _Forked(starter.spawn(env, cwd, self.run_dir, [out_w, err_w, lifeline_r]), starter)
            except OSError:
                pass  # the starter broke: this rank starts cold, and the next call gets a new starter
        proc = subprocess.Popen(
            [sys.executable, "-c", rank_entry.BOOTSTRAP, self.run_dir],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out_w,
            stderr=err_w,
            pass_fds=(lifeline_r,),
            start_new_session=True,  # its own process group: teardown reaches its children
        )
        return _Fresh(proc)

    # -- the one loop ------------------------------------------------------------------

    def _watch(self) -> str:
        """Wait for every rank; return 'succeeded', 'failed' or 'timeout' with ranks still alive or reaped."""
        timeout = self.request.timeout
        deadline = None if timeout is None else self.started + timeout
        poll_s = TICK_S if all(r.pidfd is not None for r in self.ranks) else 0.1
        next_tick = 0.0
        seen_alive = time.monotonic()  # every rank was alive when this was last taken
        while True:
            now = time.monotonic()
            for r in self.ranks:
                if r.exit_code is None:
                    if r.proc.poll() is not None:
                        self._exited(r, r.dead_since or seen_alive)
                    elif r.dead_since is None and self._dead(r):
                        r.dead_since = seen_alive  # gone; its exit code is still on its way (warm ranks)
            seen_alive = now
            self.tracker.update(r.proc.pid for r in self.ranks if r.exit_code is None)
            if now >= next_tick:
                next_tick = now + TICK_S
                self.bus.emit(Tick(elapsed=now - self.started))
            if any(r.state is RankState.FAILED for r in self.ranks):
                self._settle()
                return "failed"
            if all(r.exit_code is not None for r in self.ranks):
                return "succeeded"
            wait = poll_s
            if deadline is not None:
                wait = min(wait, deadline - now)
                if wait <= 0:
                    return "timeout"
            for key, _ in self.selector.select(wait):
                ranked, stream = key.data
                if stream is not None:
                    self._read(key.fd, ranked, stream)
                elif ranked == "starter":
                    self._pump_starter(key.fileobj)
                # A readable pidfd needs nothing here: the poll at the top reaps it.

    def _dead(self, r: _RankProcess) -> bool:
        """The rank's process is gone (its pidfd is readable), whether or not its exit code is known."""
        if r.pidfd is None:
            return False
        ready, _, _ = select.select([r.pidfd], [], [], 0)
        return bool(ready)

    def _settle(self, wait_s: float = 1.0) -> None:
        """Before teardown, collect the exit codes of ranks that already died on their own.

        A warm rank's exit code comes from the starter, a moment after its death; a rank
        that died first must count as a failure (the root cause), not as one we stopped.
        """
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            pending = [
                r for r in self.ranks if r.exit_code is None and (r.dead_since is not None or self._dead(r))
            ]
            if not pending:
                return
            for r in pending:
                if r.dead_since is None:
                    r.dead_since = time.monotonic()
                if r.proc.poll() is not None:
                    self._exited(r, r.dead_since)
            time.sleep(0.005)

    def _pump_starter(self, starter: Any) -> None:
        starter.poll(-1)  # store the exit reports; the poll at the top of the loop reads them
        if not starter.alive():
            self.selector.unregister(starter)

    def _read(self, fd: int, ranked: _RankProcess, stream: str) -> bool:
        try:
            data = os.read(fd, _READ_SIZE)
        except BlockingIOError:
            return True
        if not data:
            self.selector.unregister(fd)
            os.close(fd)
            return False
        self.router.feed(ranked.rank, stream, data)
        return True

    def _exited(self, r: _RankProcess, last_seen_alive: float) -> None:
        r.exit_code = r.proc.returncode
        r.exited_at = last_seen_alive
        if r.pidfd is not None:
            self.selector.unregister(r.pidfd)
        ok = r.exit_code == 0 and os.path.exists(wire.result_path(self.run_dir, r.rank))
        r.state = RankState.SUCCEEDED if ok else RankState.FAILED
        self.bus.emit(
            RankExited(
                rank=r.rank, state=r.state, exit_code=r.exit_code, reason=_exit_reason(r.exit_code, ok)
            )
        )

    # -- stopping ----------------------------------------------------------------------

    def _stop(self, grace_s: float) -> None:
        procs = [r.proc for r in self.ranks]
        if not procs:
            return
        try:
            stop_trees(procs, grace_s, self.tracker.seen.values())
        except KeyboardInterrupt:  # a second interrupt: no more grace
            stop_trees(procs, 0, self.tracker.seen.values())
            raise
        finally:
            for r in self.ranks:
                if r.exit_code is None:
                    r.exit_code = r.proc.returncode
                    r.state = RankState.KILLED
                    self.bus.emit(
                        RankExited(
                            rank=r.rank, state=r.state, exit_code=r.exit_code, reason="stopped by air_magic"
                        )
                    )

    def _drain(self) -> None:
        """Read what is left in the pipes after the ranks are gone, for at most _DRAIN_S."""
        for key in list(self.selector.get_map().values()):
            if key.data[1] is None:  # pidfds and the starter's socket: nothing more to learn there
                self.selector.unregister(key.fileobj)
        end = time.monotonic() + _DRAIN_S
        while self.selector.get_map() and time.monotonic() < end:
            pipes = [k for k in self.selector.get_map().values() if k.data[1] is not None]
            if not pipes:
                break
            for key, _ in self.selector.select(max(0.0, end - time.monotonic())):
                ranked, stream = key.data
                if stream is not None:
                    while self._read(key.fd, ranked, stream):
                        pass
        for key in list(self.selector.get_map().values()):
            self.selector.unregister(key.fileobj)
            if key.data[1] is not None:
                os.close(key.fd)  # a pipe's read end; pidfds and the starter's socket are closed elsewhere

    # -- outcomes ----------------------------------------------------------------------

    def _results(self) -> list[Any]:
        results = []
        for r in self.ranks:
            data = wire.read_bytes(wire.result_path(self.run_dir, r.rank))
            assert data is not None  # checked when the rank exited
            try:
                results.append(serialization.loads(data))
            except Exception as exc:
                raise PayloadError(f"rank {r.rank}'s return value could not be loaded here: {exc}") from exc
        return results

    def _error(self, outcome: str) -> BaseException:
        if outcome == "timeout":
            running = [r for r in self.ranks if r.exit_code is None]
            self._stop(self.request.grace_s)
            self._drain()
            lines = []
            for r in running:
                tail = self.router.tails[r.rank].last(5)
                shown = "\n".join(f"      {line}" for line in tail) if tail else "      (nothing printed)"
                lines.append(f"  rank {r.rank} was still running; its last lines:\n{shown}")
            return DistributedTimeoutError(
                f"timed out after {self.request.timeout:g} s (timeout={self.request.timeout:g}); "
                "every rank was stopped.\n" + "\n".join(lines) + f"\n  Logs: {self.log_dir}",
                still_running=[r.rank for r in running],
                log_dir=self.log_dir,
            )
        first_failure_at = min(
            r.exited_at for r in self.ranks if r.state is RankState.FAILED and r.exited_at is not None
        )
        self._stop(self.request.grace_s)
        self._drain()
        failures = self._failures(first_failure_at)
        error = build_exception(
            failures,
            world_size=self.world,
            log_path=self.router.log_path,
            last_lines=lambda rank: self.router.tails[rank].last(10),
        )
        self.failed_rank = min(failures, key=lambda f: (f.time, f.rank)).rank
        return error

    def _failures(self, teardown_at: float) -> list[RankFailure]:
        """Every rank that failed on its own: it reported an error, or died before teardown began."""
        failures = []
        for r in self.ranks:
            data = wire.read_bytes(wire.error_path(self.run_dir, r.rank))
            if data is not None:
                record = serialization.loads(data)
                failures.append(RankFailure(r.rank, record.time, r.exit_code, record))
            elif r.state is RankState.FAILED and r.exited_at is not None and r.exited_at <= teardown_at:
                failures.append(RankFailure(r.rank, r.exited_at, r.exit_code, None))
        return failures


def _exit_reason(code: int | None, ok: bool) -> str:
    if ok:
        return "returned"
    if code == 1:
        return "raised an exception"
    return exit_words(code)
