"""The local backend's loop: start one call's ranks, watch them all at once, stop them, build the outcome.

One thread waits on everything with a selector: each rank's stdout and stderr
pipes (to :class:`~air_magic.backends.output.OutputRouter`), a pidfd per rank
(a death wakes the loop at once), the warm starter's exit reports, the
deadline, and a stop request. The first failure, the timeout, an interrupt or
a stop ends the loop; every rank's tree is then stopped
(:func:`air_magic.process_tree.stop_trees`), the pipes drained, and the outcome
built (``launch/failures.py`` names the root cause).

Where a rank is started: :meth:`CallLoop._start_ranks`, through ``ranks.spawn_rank``.
"""

from __future__ import annotations

import functools
import os
import select
import selectors
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from air_magic.backends.local import warm
from air_magic.backends.local.ranks import RankPipes, RankSlot, send_signal, spawn_rank
from air_magic.backends.local.rendezvous import LOOPBACK
from air_magic.backends.local.session_pipes import SessionPipes
from air_magic.backends.output import OutputRouter
from air_magic.errors import DistributedTimeoutError, LaunchError, PayloadError
from air_magic.launch.failures import RankFailure, build_exception, exit_words, raised_on_its_own
from air_magic.launch.rank_env import RankPlace, rank_environment
from air_magic.launch.request import LaunchRequest, RunResult, StopRequest, rank_succeeded
from air_magic.launch.stacks import discard_rank_files, take_stacks, timeout_section
from air_magic.process_tree import DescendantTracker, stop_trees
from air_magic.protocol import serialization, wire
from air_magic.protocol.events import (
    EventBus,
    RankExited,
    RankStarted,
    RankState,
    RunFinished,
    Tick,
)

# How long ranks get between SIGTERM and SIGKILL: long enough for Python to run its atexit
# hooks and flush logs, short enough that a stuck rank does not hold the GPUs for long.
GRACE_S = 3.0  # after a failure or a timeout: SIGTERM, then SIGKILL (a stop has the call's stop_grace)
TICK_S = 0.2  # how often the loop wakes without output, for displays and the deadline
_DRAIN_S = 2.0  # output still in the pipes after the ranks are gone: read for at most this long
REPORTED_EXIT_S = 1.0  # how long a rank that reported its error may take to exit on its own
# A SIGKILL is only seen after the fact (the loop's pidfd wakes late under load), while an
# exception is stamped when it is raised. A peer's collective error follows the death it was
# caused by, and nothing a peer raises SIGKILLs a rank: a SIGKILL seen this soon after the
# earliest exception came first.
_SIGKILL_SEEN_LATE_S = 1.5


@dataclass(frozen=True)
class CallPlace:
    """Where one call lives on this machine: its id, private folder, log folder and store port."""

    run_id: str
    run_dir: str
    log_dir: str
    port: int


class CallLoop:
    """One call's ranks on this machine, from start to the last reaped process."""

    def __init__(
        self,
        request: LaunchRequest,
        bus: EventBus,
        place: CallPlace,
        *,
        warm_start: bool,
        stop_requested: StopRequest,
    ):
        self.request = request
        self.bus = bus
        self.run_id = place.run_id
        self.run_dir = place.run_dir
        self.log_dir = place.log_dir
        self.port = place.port
        self.warm_start = warm_start
        self.stop_requested = stop_requested
        self.world = request.plan.world_size
        self.ranks: list[RankSlot] = []
        self.router = OutputRouter(self.log_dir, self.world, bus)
        self.selector = selectors.DefaultSelector()
        self.pipes = RankPipes(self.selector, self.router.feed)
        self.tracker = DescendantTracker()
        self.started = time.monotonic()
        self.deadline = None if request.timeout is None else self.started + request.timeout
        self.failed_rank: int | None = None
        self.payload_gone = False
        self.teardown_at: float | None = None  # when the first stop of the ranks began
        self.ranks_ignore_sigint = False
        self.held_starter: warm.Starter | None = None
        self.session_pipes: SessionPipes | None = None  # a persistent session's line to its ranks

    # -- the whole call ----------------------------------------------------------------

    def execute(self) -> RunResult:
        """Run the call (its RunStarted was emitted by the backend as its log folder was made)."""
        lifeline_r, lifeline_w = os.pipe()
        outcome = "failed"
        error: BaseException | None = None
        try:
            try:
                channel = self.request.channel
                if channel is not None:  # a persistent session: its pipes before its ranks open them
                    self.session_pipes = SessionPipes(self.run_dir, range(self.world))
                    for fd in self.session_pipes.open():
                        self.selector.register(fd, selectors.EVENT_READ, ("channel", None))
                    channel.connect(_LoopCells(self, self.session_pipes))
                started = self._start_ranks(lifeline_r)
            finally:
                os.close(lifeline_r)
            if not started and self.stop_requested.is_set():
                outcome, error = "interrupted", self._stopped_error()
                return RunResult(self.run_id, self.log_dir, outcome, error=error)
            if not started:
                outcome, error = "timeout", self._starter_timeout()
                return RunResult(self.run_id, self.log_dir, outcome, error=error)
            outcome = self._watch()
            if outcome == "interrupted":  # stop() from another thread
                self._interrupt(self.stop_requested.signum)
                error = self._stopped_error()
            elif outcome == "succeeded":
                try:
                    return RunResult(self.run_id, self.log_dir, outcome, values=self._results())
                except PayloadError as exc:
                    outcome, error = "failed", exc
            else:
                error = self._error(outcome)
            return RunResult(self.run_id, self.log_dir, outcome, error=error)
        except KeyboardInterrupt as exc:
            outcome = "interrupted"
            self._interrupt(getattr(exc, "signum", signal.SIGINT))
            raise
        finally:
            self._stop(GRACE_S)  # no-op when every rank is already reaped
            self.pipes.drain(_DRAIN_S)
            self.router.close()
            discard_rank_files(self.log_dir)  # the ranks are gone: their stack files with them
            self.selector.close()
            if self.session_pipes is not None:
                self.session_pipes.close()
            os.close(lifeline_w)  # last: ranks die with the lifeline if anything above failed
            if self.held_starter is not None:
                warm.release(self.held_starter)
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

    def _start_ranks(self, lifeline_r: int) -> bool:
        """Start every rank; False when the call's timeout ran out first (waiting for the starter)."""
        cwd = os.getcwd()
        self.ranks_ignore_sigint = warm.sigint_ignored()  # as the ranks will start (exec keeps SIG_IGN)
        envs = [
            rank_environment(
                place=RankPlace.on_one_node(rank, self.world),
                plan=self.request.plan,
                master_addr=LOOPBACK,
                master_port=self.port,
                run_id=self.run_id,
                run_dir=self.run_dir,
                log_dir=self.log_dir,
                lifeline_fd=lifeline_r,
                extra=self.request.env,
            )
            for rank in range(self.world)
        ]
        starter = None
        if self.warm_start:
            starter = self._ready_starter(envs[0])
            if starter is None and (self._deadline_passed() or self.stop_requested.is_set()):
                return False
        if starter is not None:
            # Held (by get_starter): not closed by a rebuild or %distributed restart while its
            # forks run this call; released when every rank is reaped.
            self.held_starter = starter
            # Its exit reports wake the loop as soon as they come.
            self.selector.register(starter, selectors.EVENT_READ, ("starter", None))
        for rank, env in enumerate(envs):
            try:
                spawn = functools.partial(spawn_rank, starter, rank, env, cwd, self.run_dir, lifeline_r)
                ranked = self.pipes.start(rank, spawn)
            except OSError as exc:
                raise LaunchError(f"could not start rank {rank} with {sys.executable}: {exc}") from exc
            self.ranks.append(ranked)
            ranked.state = RankState.RUNNING
            self.bus.emit(RankStarted(rank=rank, pid=ranked.proc.pid))
        return True

    def _ready_starter(self, env: dict[str, str]) -> warm.Starter | None:
        """The warm starter for ranks with this environment, waited for no longer than the call's
        timeout, nor past a stop()."""
        wait = warm.starter_wait_s()
        if self.deadline is not None:
            wait = min(wait, max(0.0, self.deadline - time.monotonic()))
        end = time.monotonic() + wait
        startup = warm.startup_environment(env)
        while True:
            # In slices, so that a stop() from another thread is seen while the starter imports.
            slice_s = min(TICK_S, max(0.0, end - time.monotonic()))
            starter = warm.get_starter(self.request.log_root, startup, wait_s=slice_s, hold=True)
            if starter is not None or warm.starting() is None or not warm.serves(startup):
                # ready; or none is coming for this call (another call waits for one of its own)
                return starter
            if self.stop_requested.is_set() or time.monotonic() >= end:
                return None

    def _stopped_error(self) -> LaunchError:
        return LaunchError(f"{self.request.name} was stopped before it finished; every rank is gone")

    def _deadline_passed(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    # -- looking inside ----------------------------------------------------------------

    def running_pids(self) -> dict[int, int]:
        """rank -> pid of every rank not yet reaped (from any thread)."""
        return {r.rank: r.proc.pid for r in list(self.ranks) if r.exit_code is None}

    def stacks(self, why: str = "on request") -> dict[int, str]:
        """Every running rank's thread stacks (launch/stacks.py), from any thread."""
        return take_stacks(self.running_pids(), self.log_dir, why)

    # -- the one loop ------------------------------------------------------------------

    def _watch(self) -> str:
        """Wait for every rank; return 'succeeded', 'failed', 'timeout' or 'interrupted' (stop())."""
        deadline = self.deadline
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
                self._forget_payload_once_loaded()
                self._note_reported_failures(now)
            if self.stop_requested.is_set():
                return "interrupted"
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
                    self.pipes.read(key.fd, ranked, stream)
                elif ranked == "starter":
                    self._pump_starter(key.fileobj)
                elif ranked == "channel":
                    self._answers(key.fd)
                # A readable pidfd needs nothing here: the poll at the top reaps it.

    def _answers(self, fd: int) -> None:
        """A session rank's answers: everything it printed before each goes to the consumers first."""
        assert self.session_pipes is not None and self.request.channel is not None
        for rank, answer, outcome in self.session_pipes.read(fd):
            if 0 <= rank < len(self.ranks):
                self.pipes.drain_rank(self.ranks[rank])
            self.request.channel.answered(rank, answer, outcome)

    def interrupt(self, ranks: list[int]) -> None:
        """SIGINT to these ranks (a session's cell), skipping any whose process has ended."""
        for r in list(self.ranks):
            if r.rank in ranks and r.exit_code is None and r.dead_since is None:
                send_signal(r, signal.SIGINT)

    def _note_reported_failures(self, now: float) -> None:
        """A rank that reported its exception has failed, even if its process has not ended yet.

        Its interpreter may wait for non-daemon threads or multiprocessing children
        while exiting (as any Python process does); after REPORTED_EXIT_S the others are
        not kept waiting for that: the call fails and every rank is stopped.
        """
        for r in self.ranks:
            if r.exit_code is None and r.state is RankState.RUNNING:
                raised_at = self._error_time(r.rank)
                if raised_at is not None and now - raised_at >= REPORTED_EXIT_S:
                    r.state, r.exited_at = RankState.FAILED, raised_at

    def _forget_payload_once_loaded(self) -> None:
        """Delete the payload (the arguments, in clear) as soon as every rank has read it."""
        if self.payload_gone:
            return
        if all(os.path.exists(wire.loaded_path(self.run_dir, r.rank)) for r in self.ranks):
            self.payload_gone = True
            try:
                os.unlink(os.path.join(self.run_dir, wire.PAYLOAD_FILE))
            except OSError:
                pass

    def _dead(self, r: RankSlot) -> bool:
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

    def _exited(self, r: RankSlot, last_seen_alive: float) -> None:
        r.exit_code = r.proc.returncode
        r.exited_at = last_seen_alive
        if r.pidfd is not None:
            self.selector.unregister(r.pidfd)
        self.pipes.drain_rank(r)  # all its output before its exit
        ok = rank_succeeded(self.request, r.exit_code, os.path.exists(wire.result_path(self.run_dir, r.rank)))
        r.state = RankState.SUCCEEDED if ok else RankState.FAILED
        reason = _exit_reason(None if r.status_lost and not ok else r.exit_code, ok)
        self.bus.emit(RankExited(rank=r.rank, state=r.state, exit_code=r.exit_code, reason=reason))

    # -- stopping ----------------------------------------------------------------------

    def _interrupt(self, signum: int) -> None:
        """A stop (Ctrl-C, the stop button, cancel(), a signal to the command line): the ranks get
        ``signum`` (SIGINT: KeyboardInterrupt, so ``except KeyboardInterrupt: save()`` runs), then the
        call's stop grace, then SIGKILL, as torchrun does. Their output keeps flowing meanwhile."""
        if signum == signal.SIGINT and self.ranks_ignore_sigint:  # they would wait out the grace
            signum = signal.SIGTERM
        self._stop(self.stop_requested.grace(self.request.stop_grace), signal.Signals(signum))

    def _stop(self, grace_s: float, ask: signal.Signals = signal.SIGTERM) -> None:
        procs = [r.proc for r in self.ranks]
        if not procs:
            return
        if self.teardown_at is None:
            self.teardown_at = time.monotonic()
        try:
            # Output is read during an interrupt's long grace only (a failure's or timeout's 3 s as before).
            meanwhile = self.pipes.pump if ask != signal.SIGTERM or grace_s > GRACE_S else None
            stop_trees(procs, grace_s, self.tracker.seen.values(), ask=ask, meanwhile=meanwhile)
        except KeyboardInterrupt:  # a second interrupt: no more grace
            stop_trees(procs, 0, self.tracker.seen.values())
            raise
        finally:
            for r in self.ranks:
                if r.exit_code is None:
                    self._stopped(r)

    def _stopped(self, r: RankSlot) -> None:
        """Record a rank that was still unreaped at teardown: stopped by us, unless it ended on its own."""
        r.exit_code = r.proc.returncode
        self.pipes.drain_rank(r)
        returned = os.path.exists(wire.result_path(self.run_dir, r.rank))
        raised_at = self._error_time(r.rank)
        if raised_at is not None and (self.teardown_at is None or raised_at < self.teardown_at):
            # It failed by itself, just before the others were stopped (its exit code came late).
            r.state, reason = RankState.FAILED, "raised an exception"
        elif raised_at is not None and raised_on_its_own(
            wire.read_bytes(wire.error_path(self.run_dir, r.rank))
        ):
            # Its own exception (the same CUDA call failing in every rank, a peer's lost connection):
            # it failed, even if the record came a moment after the first failure stopped the others.
            r.state, reason = RankState.FAILED, "raised an exception"
        elif raised_at is not None:
            r.state, reason = RankState.KILLED, "stopped by air_magic (it raised while stopping)"
        elif returned and r.exit_code == 0:  # it returned and finished exiting meanwhile
            r.state, reason = RankState.SUCCEEDED, "returned"
        elif returned:
            r.state, reason = RankState.KILLED, "stopped by air_magic after it returned, while it was exiting"
        else:
            r.state, reason = RankState.KILLED, "stopped by air_magic"
        self.bus.emit(RankExited(rank=r.rank, state=r.state, exit_code=r.exit_code, reason=reason))

    # -- outcomes ----------------------------------------------------------------------

    def _results(self) -> list[Any]:
        results: list[Any] = []
        for r in self.ranks:
            data = wire.read_bytes(wire.result_path(self.run_dir, r.rank))
            if data is None:  # a script's rank that ended with os._exit(0): nothing to return
                assert self.request.exit_zero_succeeds, f"rank {r.rank} succeeded without a result"
                results.append(None)
                continue
            try:
                results.append(serialization.loads(data))
            except Exception as exc:
                raise PayloadError(f"rank {r.rank}'s return value could not be loaded here: {exc}") from exc
        return results

    def _error(self, outcome: str) -> BaseException:
        if outcome == "timeout":
            running = [r for r in self.ranks if r.exit_code is None]
            returned = {r.rank for r in running if os.path.exists(wire.result_path(self.run_dir, r.rank))}
            # Before they are stopped: what each rank was doing when the time ran out.
            stacks = self.stacks(why="at the timeout")
            self._stop(GRACE_S)
            self.pipes.drain(_DRAIN_S)
            lines = []
            for r in running:
                tail = self.router.tails[r.rank].last(5)
                shown = "\n".join(f"      {line}" for line in tail) if tail else "      (nothing printed)"
                if r.rank in returned:
                    what = (
                        "had returned but was still exiting (Python waits for non-daemon threads "
                        "and atexit hooks before a process ends)"
                    )
                else:
                    what = "was still running"
                lines.append(f"  rank {r.rank} {what}; its last lines:\n{shown}")
            lines += timeout_section(stacks, self.log_dir)
            return DistributedTimeoutError(
                f"timed out after {self.request.timeout:g} s (timeout={self.request.timeout:g}); "
                "every rank was stopped.\n" + "\n".join(lines) + f"\n  Logs: {self.log_dir}",
                still_running=[r.rank for r in running],
                log_dir=self.log_dir,
            )
        if warm.process_exiting():
            self._stop(0)
            return LaunchError(
                "the call was stopped: the Python process that made it is exiting "
                "(a call in a daemon thread does not keep a process alive)"
            )
        first_failure_at = min(
            r.exited_at for r in self.ranks if r.state is RankState.FAILED and r.exited_at is not None
        )
        self._stop(GRACE_S)
        self.pipes.drain(_DRAIN_S)
        failures = self._failures(first_failure_at)
        error = build_exception(
            failures,
            world_size=self.world,
            log_path=self.router.log_path,
            last_lines=lambda rank: self.router.tails[rank].last(10),
            cpu_mode=self.request.plan.cpu_mode,
        )
        self.failed_rank = min(failures, key=lambda f: (f.time, f.rank)).rank
        return error

    def _error_time(self, rank: int) -> float | None:
        """When the rank reported its own failure (the machine's monotonic clock), if it did."""
        data = wire.read_bytes(wire.error_path(self.run_dir, rank))
        if data is None:
            return None
        try:
            return float(serialization.loads(data).time)
        except Exception:  # noqa: BLE001 - a torn record still says it failed; when is unknown
            return float("-inf")

    def _starter_timeout(self) -> BaseException:
        """The call's timeout ran out while the warm starter was still importing: no rank ever ran."""
        starter = warm.starting()
        who = f"the warm starter (pid {starter.proc.pid})" if starter is not None else "the warm starter"
        log = f" Its log: {starter.log_path}." if starter is not None and starter.log_path else ""
        return DistributedTimeoutError(
            f"timed out after {self.request.timeout:g} s (timeout={self.request.timeout:g}) before any "
            f"rank started: {who} was still importing {', '.join(warm.preload_list()) or 'its modules'}."
            f"{log} No rank ran. A longer timeout lets it finish (later calls then start in "
            "milliseconds); warm_start=False starts fresh ranks instead.",
            still_running=[],
            log_dir=self.log_dir,
        )

    def _failures(self, teardown_at: float) -> list[RankFailure]:
        """Every rank that failed on its own: it reported an error, or died before teardown began."""
        failures = []
        for r in self.ranks:
            data = wire.read_bytes(wire.error_path(self.run_dir, r.rank))
            if data is not None:
                record = serialization.loads(data)
                failures.append(RankFailure(r.rank, record.time, r.exit_code, record))
            elif r.state is RankState.FAILED and r.exited_at is not None and r.exited_at <= teardown_at:
                code = None if r.status_lost else r.exit_code  # None: "unknown, the starter died"
                failures.append(RankFailure(r.rank, r.exited_at, code, None))
        reported = [f.time for f in failures if f.record is not None]
        if reported:
            first = min(reported)
            for f in failures:
                if (
                    f.record is None
                    and f.exit_code == -signal.SIGKILL
                    and f.time <= first + _SIGKILL_SEEN_LATE_S
                ):
                    f.time = min(f.time, first - 1e-6)
        return failures


class _LoopCells:
    """The local backend's CellSender: the session's pipes, and SIGINT through the loop's ranks."""

    def __init__(self, loop: CallLoop, pipes: SessionPipes):
        self._loop, self._pipes = loop, pipes

    def send_cell(self, number: int, payload: bytes) -> None:
        self._pipes.send_cell(number, payload)

    def send_stop(self) -> None:
        self._pipes.send_stop()

    def interrupt(self, ranks: list[int]) -> None:
        self._loop.interrupt(ranks)


def _exit_reason(code: int | None, ok: bool) -> str:
    if ok:
        return "returned"
    if code == 1:
        return "raised an exception"
    if code is not None and code > 1:  # a script's sys.exit(N)
        return f"exited with status {code}"
    return exit_words(code)
