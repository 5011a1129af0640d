"""The Ray backend's loop, in the caller: start a call's ranks through the node agents, follow them, end it.

One call, on the pool of agents that placement.py reserved::

    ranks numbered node by node (rank 0 on the first node, which hosts the rendezvous store)
    payload put in Ray's object store once; each agent writes it into its node's call folder
    agents start their ranks (agent.py)                      -> RankStarted
    long polls on every agent at once (ray.wait)             -> output, errors, exits, metric lines
      output -> backends/output.OutputRouter (the caller's log folder, RankOutput events, tails)
    the first failure, the timeout, an interrupt or stop()   -> every agent stops its ranks
    failures ordered (below) -> launch/failures.build_exception; results in rank order

**Which failure is the root cause.** Across machines, arrival order says
little: a rank killed on one node and the collective error it causes on
another arrive within the same poll. So a rank's own failure (an exception of
its own, a death, a lost node) comes before the *collateral* errors of the
others (torch.distributed's errors, a closed connection, a store timeout), and
only then does time decide (each node's monotonic clock, turned into wall-clock
time with the offset its agent reported).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from typing import Any

from air_magic import private_files
from air_magic.backends.output import OutputRouter, make_log_dir
from air_magic.backends.ray.placement import Pool
from air_magic.errors import DistributedTimeoutError, LaunchError, PayloadError, RankFailedError
from air_magic.launch.failures import RankFailure, build_exception, exit_words, raised_on_its_own
from air_magic.launch.request import LaunchRequest, RunResult, StopRequest, new_run_id, rank_succeeded
from air_magic.launch.stacks import discard_rank_files, timeout_section
from air_magic.protocol import env_names, serialization, wire
from air_magic.protocol.events import (
    EventBus,
    RankExited,
    RankStarted,
    RankState,
    RunFinished,
    RunStarted,
    Tick,
)

TICK_S = 0.2
POLL_S = 0.5  # an agent's long poll returns at once when it has news, else after this
GRACE_S = 3.0
REPORTED_EXIT_S = 1.0  # as local: a rank that reported its error and has not exited by then has failed
SETTLE_S = 0.5  # after the first failure, news still on its way from other nodes is taken in first
STACKS_WAIT_S = 30.0  # every node's dumps (py-spy takes up to 10 s on a rank that does not answer)
STOP_WAIT_S = 10.0  # after the stop, how long agents get to report their ranks' exits
MAX_POLL_ERRORS = 5  # an agent that fails this many polls in a row (unreachable, not dead) is lost
# A live agent answers every poll within POLL_S. One silent this long is taken for lost: when a
# node dies, Ray may end the agent's process before its watchdog can say so, and tells the
# caller only after its own health checks (12-15 s, measured).
SILENT_AGENT_S = 5.0
START_WAIT_S = 120.0  # agents start ranks in milliseconds; a warm starter may import torch first
COLLATERAL_S = 1e9  # added to a collateral failure's time: it sorts after every rank's own failure

# What a rank raises when *another* rank failed: torch.distributed's errors, and the words of
# gloo, NCCL, c10d and the store in a RuntimeError when a peer vanished. Whole words only: a user's
# "Failed to restore checkpoint" or "DataLoader timed out" is the user's own failure.
_COLLATERAL_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")
_COLLATERAL_WORDS = re.compile(
    r"connection closed by peer|connection reset by peer|broken pipe|socket timeout"
    r"|\b(gloo|nccl|c10d|processgroup\w*|tcpstore)\b",
    re.IGNORECASE,
)


def is_collateral(type_name: str, message: str) -> bool:
    """An error a rank raises because another one failed (so it is not the root cause)."""
    short = type_name.rsplit(".", 1)[-1]
    if short in _COLLATERAL_TYPES:
        return True
    return short == "RuntimeError" and _COLLATERAL_WORDS.search(message) is not None


class RankRecord:
    """What the caller knows of one rank."""

    def __init__(self, rank: int, node: int):
        self.rank = rank
        self.node = node
        self.pid: int | None = None
        self.state = RankState.STARTING
        self.exit_code: int | None = None
        self.exit_time: float | None = None  # on its node's monotonic clock
        self.result: bytes | None = None
        self.error: bytes | None = None
        self.raised_seen: float | None = None  # the caller's clock, when its error record arrived
        self.node_lost = False
        self.status_lost = False
        self.never_started = False  # the call was stopped before its agent started it

    @property
    def exited(self) -> bool:
        return self.exit_code is not None or self.node_lost or self.never_started


class RayRun:
    """One call on a pool of node agents."""

    def __init__(
        self,
        request: LaunchRequest,
        bus: EventBus,
        pool: Pool,
        *,
        warm_start: bool,
        stop_requested: StopRequest,
        starter_wait_s: float,
    ):
        import ray

        self.ray = ray
        self.request = request
        self.bus = bus
        self.pool = pool
        self.warm_start = warm_start
        self.stop_requested = stop_requested
        self.starter_wait_s = starter_wait_s
        self.world = request.plan.world_size
        self.run_id = request.run_id or new_run_id()
        self.log_dir = make_log_dir(request.log_root, self.run_id)
        self.router = OutputRouter(self.log_dir, self.world, bus)
        self.started = time.monotonic()
        self.deadline = None if request.timeout is None else self.started + request.timeout
        self.ranks: list[RankRecord] = []
        for node, count in enumerate(pool.shape.counts):
            self.ranks.extend(RankRecord(len(self.ranks), node) for _ in range(count))
        self.agents = pool.agents
        self.done_nodes: set[int] = set()
        self.lost_nodes: set[int] = set()  # their agent died, or stopped answering
        self.lost_reasons: dict[int, str] = {}
        self.polls: dict[Any, int] = {}  # outstanding poll -> node
        self.polled_at: dict[int, float] = {}  # node -> when its outstanding poll was sent
        self.side_calls: list[Any] = []  # stop() calls, fetched at the end
        self._started_nodes: set[int] = set()  # nodes whose start() has answered
        self.starts: dict[Any, int] = {}  # outstanding start -> node
        self.poll_errors: dict[int, int] = {}
        self.teardown_at: float | None = None
        self.failed_rank: int | None = None
        self.metric_fds: dict[int, int] = {}

    # -- the whole call ------------------------------------------------------------------

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
            )
        )
        outcome = "failed"
        error: BaseException | None = None
        try:
            started = self._start()
            if not started:
                outcome = "interrupted" if self.stop_requested.is_set() else "timeout"
                error = self._stopped_error() if outcome == "interrupted" else self._timeout_error()
                return RunResult(self.run_id, self.log_dir, outcome, error=error)
            outcome = self._watch()
            if outcome == "succeeded":
                try:
                    return RunResult(self.run_id, self.log_dir, outcome, values=self._results())
                except PayloadError as exc:
                    outcome, error = "failed", exc
            elif outcome == "interrupted":
                self._stop(self.stop_requested.grace(self.request.stop_grace), self.stop_requested.signum)
                error = self._stopped_error()
            elif outcome == "timeout":
                running = [r.rank for r in self.ranks if not r.exited]
                stacks = self.stacks()  # before they are stopped
                self._stop(GRACE_S)
                error = self._timeout_error(running, stacks)
            else:
                self._stop(GRACE_S)
                error = self._failure_error()
            return RunResult(self.run_id, self.log_dir, outcome, error=error)
        except KeyboardInterrupt as exc:
            outcome = "interrupted"
            self._stop(
                self.stop_requested.grace(self.request.stop_grace), getattr(exc, "signum", signal.SIGINT)
            )
            raise
        finally:
            self._stop(GRACE_S)
            self._finish_agents()
            self.router.close()
            discard_rank_files(self.log_dir)  # the ranks are gone: their stack files with them
            for fd in self.metric_fds.values():
                os.close(fd)
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

    # -- starting ------------------------------------------------------------------------

    def _start(self) -> bool:
        """Start every rank; False if the timeout or a stop came first (then _stop cleans up).

        Each agent is polled as soon as its ranks are started, not when the slowest node is
        ready: its ranks' output flows, and its watchdog sees a caller that is there.
        """
        ray, nodes = self.ray, self.pool.nodes
        master = nodes[0]["ip"]
        opened = self.agents[0].open_store.remote(self.run_id, self.world, master)
        port = ray.get(opened, timeout=START_WAIT_S)
        payload = ray.put(self.request.payload)  # once, whatever the number of nodes
        if self.request.channel is not None:  # a persistent session: its line, before its ranks answer
            self.request.channel.connect(_RayCells(self))
        wait = self.starter_wait_s
        if self.deadline is not None:
            wait = max(0.0, min(wait, self.deadline - time.monotonic()))
        for node, agent in enumerate(self.agents):
            spec = {
                "run_id": self.run_id,
                "ranks": [r.rank for r in self.ranks if r.node == node],
                "world_size": self.world,
                "node_rank": node,
                "master_addr": master,
                "master_port": port,
                "cpu_mode": self.request.plan.cpu_mode,
                "detected": self.request.plan.detected,
                "env": dict(self.request.env),
                "sys_path": list(sys.path),
                "argv": list(sys.argv) or [""],
                "cwd": os.getcwd(),
                "log_dir": self.log_dir,
                "warm_start": self.warm_start,
                "starter_wait_s": wait,
                "session": self.request.channel is not None,
            }
            self.starts[agent.start.remote(spec, payload)] = node
        end = time.monotonic() + START_WAIT_S
        while self.starts:
            if self.stop_requested.is_set() or self._deadline_passed():
                return False
            if time.monotonic() > end:
                raise LaunchError(f"the Ray agents did not start the ranks within {START_WAIT_S:g} s")
            self._take_starts(TICK_S)
            self._pump(0.0)  # the nodes already started: their output, and proof of a caller
        return True

    def _take_starts(self, wait_s: float) -> None:
        """Take in the agents' answers to start(): pids, then a poll on that agent."""
        ready, _ = self.ray.wait(list(self.starts), num_returns=len(self.starts), timeout=wait_s)
        for ref in ready:
            node = self.starts.pop(ref)
            try:
                started = self.ray.get(ref)
            except Exception as exc:  # an agent died or could not start a rank
                if _actor_died(exc):
                    self._node_lost(node)
                raise LaunchError(
                    f"could not start the ranks on node {node} ({self.pool.nodes[node]['ip']}): {exc}"
                ) from exc
            finally:
                self._repoll(node)
            for rank, pid in started:
                record = self.ranks[rank]
                record.pid, record.state = pid, RankState.RUNNING
                self.bus.emit(RankStarted(rank=rank, pid=pid))
            self._started_nodes.add(node)
            missing = [r for r in self.ranks if r.node == node and r.pid is None]
            if missing and self.teardown_at is None:
                raise LaunchError(
                    f"node {node} ({self.pool.nodes[node]['ip']}) started {len(started)} of its "
                    f"{len(started) + len(missing)} ranks: its agent stopped the call (see its log)"
                )
            if not started:
                self.done_nodes.add(node)  # nothing ran there: no events will come

    def _deadline_passed(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    # -- following -------------------------------------------------------------------------

    def _watch(self) -> str:
        next_tick = 0.0
        while True:
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + TICK_S
                self.bus.emit(Tick(elapsed=now - self.started))
            if self.stop_requested.is_set():
                return "interrupted"
            if self._failed(now):
                self._settle()
                return "failed"
            if all(r.exited for r in self.ranks):
                return "succeeded"
            wait = TICK_S
            if self.deadline is not None:
                wait = min(wait, self.deadline - now)
                if wait <= 0:
                    return "timeout"
            self._pump(wait)

    def _failed(self, now: float) -> bool:
        for r in self.ranks:
            if r.node_lost or r.state is RankState.FAILED:
                return True
            if r.raised_seen is not None and not r.exited and now - r.raised_seen >= REPORTED_EXIT_S:
                return True
        return False

    def _settle(self) -> None:
        """What other nodes already know (a death, an exception) arrives before the others are stopped."""
        end = time.monotonic() + SETTLE_S
        while self.polls and time.monotonic() < end and not all(r.exited for r in self.ranks):
            self._pump(max(0.0, end - time.monotonic()))

    def _pump(self, wait_s: float) -> None:
        """Take in whatever one or more agents have sent within ``wait_s``; poll them again."""
        if not self.polls:
            time.sleep(wait_s)
            return
        self._silent_agents()
        if not self.polls:
            return
        ready, _ = self.ray.wait(list(self.polls), num_returns=1, timeout=max(0.0, wait_s))
        for ref in ready:
            node = self.polls.pop(ref)
            try:
                events = self.ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - the agent died, or is unreachable for now
                self.poll_errors[node] = self.poll_errors.get(node, 0) + 1
                if _actor_died(exc) or self.poll_errors[node] > MAX_POLL_ERRORS:
                    self._node_lost(node)
                else:
                    self._repoll(node)
                continue
            self.poll_errors[node] = 0
            for event in events:
                self._handle(node, event)
            self._repoll(node)

    def _repoll(self, node: int) -> None:
        if node not in self.done_nodes and node not in self.lost_nodes and node not in self.polls.values():
            self.polls[self.agents[node].poll.remote(self.run_id, POLL_S)] = node
            self.polled_at[node] = time.monotonic()

    def _silent_agents(self) -> None:
        now = time.monotonic()
        for ref, node in list(self.polls.items()):
            if now - self.polled_at.get(node, now) > POLL_S + SILENT_AGENT_S:
                ready, _ = self.ray.wait([ref], timeout=0)
                if ready:
                    continue  # it answered; the answer is simply not read yet
                del self.polls[ref]
                self.lost_reasons.setdefault(node, f"its agent did not answer for {SILENT_AGENT_S:g} s")
                self._node_lost(node)

    def _handle(self, node: int, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "out":
            _, rank, stream, data = event
            self.router.feed(rank, stream, data)
        elif kind == "raised":
            _, rank, data = event
            record = self.ranks[rank]
            record.error = data
            if record.raised_seen is None:
                record.raised_seen = time.monotonic()
        elif kind == "lost":  # the agent's watchdog: its node is going (the raylet died)
            self.lost_reasons[node] = event[1]
            self._node_lost(node)
        elif kind == "exit":
            _, rank, code, when, result, error, status_lost, teardown_at = event
            record = self.ranks[rank]
            if record.node_lost:
                return  # killed with its node: already reported as lost
            record.exit_code, record.exit_time, record.status_lost = code, when, status_lost
            record.result, record.error = result, error if error is not None else record.error
            self._exited(record, teardown_at)
        elif kind == "metrics":
            _, rank, data = event
            self._append_metrics(rank, data)
        elif kind == "answer" and self.request.channel is not None:  # a session rank ended a cell
            _, rank, answer, outcome = event
            self.request.channel.answered(rank, answer, outcome)
        elif kind == "done":
            self.done_nodes.add(node)
            if any(r.node == node and not r.exited and r.pid is not None for r in self.ranks):
                self._node_lost(node)  # its agent stopped watching them (it said why in its log)

    def _exited(self, r: RankRecord, teardown_at: float | None) -> None:
        ok = rank_succeeded(self.request, r.exit_code, r.result is not None)
        raised_at = self._error_time(r)
        if ok:
            r.state, reason = RankState.SUCCEEDED, "returned"
        elif teardown_at is None or (r.exit_time is not None and r.exit_time < teardown_at):
            r.state = RankState.FAILED  # it ended by itself, before its node was told to stop
            reason = "raised an exception" if r.error is not None else _death_words(r)
        elif raised_at is not None and (raised_at < teardown_at or raised_on_its_own(r.error)):
            r.state, reason = RankState.FAILED, "raised an exception"  # its own, not our stop's
        else:
            r.state, reason = RankState.KILLED, "stopped by air_magic"
        self.bus.emit(RankExited(rank=r.rank, state=r.state, exit_code=r.exit_code, reason=reason))

    def _node_lost(self, node: int) -> None:
        if node in self.lost_nodes:
            return
        self.lost_nodes.add(node)
        self.pool.broken = True  # the next call builds a new pool
        self.done_nodes.add(node)
        for r in self.ranks:
            if r.node == node and not r.exited:
                r.node_lost, r.exit_time = True, None
                r.state = RankState.FAILED if self.teardown_at is None else RankState.KILLED
                self.bus.emit(
                    RankExited(
                        rank=r.rank, state=r.state, exit_code=None, reason="its node or agent was lost"
                    )
                )

    def _append_metrics(self, rank: int, data: bytes) -> None:
        folder = self.request.env.get(env_names.METRICS_DIR)
        if not folder:
            return
        fd = self.metric_fds.get(rank)
        if fd is None:
            fd = self.metric_fds[rank] = private_files.open_private(wire.metrics_path(folder, rank))
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    # -- stopping --------------------------------------------------------------------------

    def _stop(self, grace_s: float, signum: int = signal.SIGTERM) -> None:
        """Every agent stops its ranks of this call (also ranks it is still starting; ``signum``
        first, then ``grace_s``); their exits are taken in, for at most STOP_WAIT_S + grace.
        Returns with every rank accounted for."""
        if self.teardown_at is not None and all(r.exited for r in self.ranks) and not self.starts:
            return
        if self.teardown_at is None:
            self.teardown_at = time.monotonic()
        for agent in self.agents:  # a node taken for lost may only be silent: told too
            self.side_calls.append(agent.stop.remote(self.run_id, grace_s, int(signum)))
        end = time.monotonic() + grace_s + STOP_WAIT_S
        try:
            while self.starts and time.monotonic() < end:  # a start still on its way: its pids
                try:
                    self._take_starts(TICK_S)
                except LaunchError:
                    pass  # that node's ranks were stopped by its agent; the error is not the story
            pending = set(self.starts.values())
            for node in range(len(self.agents)):
                if node not in pending and node not in self._started_nodes:
                    self.done_nodes.add(node)  # its start was never sent (an interrupt before)
            for r in self.ranks:
                if r.pid is None and not r.exited and r.node not in self.lost_nodes and r.node not in pending:
                    r.never_started, r.state = True, RankState.KILLED
            for node in range(len(self.agents)):
                self._repoll(node)  # a poll lost to an interrupt, say
            while self.polls and time.monotonic() < end:
                if all(r.exited for r in self.ranks) and len(self.done_nodes | self.lost_nodes) == len(
                    self.agents
                ):
                    break
                self._pump(min(TICK_S, max(0.0, end - time.monotonic())))
        except KeyboardInterrupt:  # a second interrupt: no more grace, on every node
            for agent in self.agents:
                self.side_calls.append(agent.stop.remote(self.run_id, 0.0, int(signal.SIGKILL)))
            end = time.monotonic() + STOP_WAIT_S
            try:
                while self.polls and time.monotonic() < end and not all(r.exited for r in self.ranks):
                    self._pump(min(TICK_S, max(0.0, end - time.monotonic())))
            except KeyboardInterrupt:  # a third: the exits are not waited for
                pass
        for r in self.ranks:
            if not r.exited:  # its agent never answered: counted as lost with its node
                self._node_lost(r.node)

    def _finish_agents(self) -> None:
        """Every live agent closes the store and removes its call folder before the call returns.
        A lost node's agent is told too (it may only have been silent) but not waited for: a
        dead actor's answer comes only after Ray's health checks (measured: 1.4 s of a 1.9 s
        node-loss error went there)."""
        refs = [a.finish.remote(self.run_id) for a in self.agents]
        live = [ref for node, ref in enumerate(refs) if node not in self.lost_nodes]
        try:
            self.ray.wait(live, num_returns=len(live), timeout=STOP_WAIT_S)
        except Exception:  # noqa: BLE001 - an agent that died meanwhile has nothing to clean
            pass
        # Fetched, so that Ray does not print "unhandled error" for a dead agent's answers later.
        for ref in [*refs, *self.side_calls, *self.polls]:
            try:
                ready, _ = self.ray.wait([ref], timeout=0)
                if ready:
                    self.ray.get(ref)
            except Exception:  # noqa: BLE001 - a dead agent's answer: nothing to do
                pass

    # -- outcomes --------------------------------------------------------------------------

    def _results(self) -> list[Any]:
        values: list[Any] = []
        for r in self.ranks:
            if r.result is None:  # a script's rank that ended with os._exit(0): nothing to return
                assert self.request.exit_zero_succeeds, f"rank {r.rank} succeeded without a result"
                values.append(None)
                continue
            try:
                values.append(serialization.loads(r.result))
            except Exception as exc:
                raise PayloadError(f"rank {r.rank}'s return value could not be loaded here: {exc}") from exc
        return values

    def _stopped_error(self) -> LaunchError:
        return LaunchError(f"{self.request.name} was stopped before it finished; every rank is gone")

    def stacks(self) -> dict[int, str]:
        """Every running rank's thread stacks, each node's agent taking its own (from any thread)."""
        found: dict[int, str] = {}
        try:
            parts = self.ray.get(
                [agent.stacks.remote(self.run_id) for agent in self.agents], timeout=STACKS_WAIT_S
            )
        except Exception:  # noqa: BLE001 - stacks are a help; a node that cannot answer gives none
            return found
        for part in parts:
            found.update(part)
        return found

    def _timeout_error(
        self, running: list[int] | None = None, stacks: dict[int, str] | None = None
    ) -> DistributedTimeoutError:
        timeout = self.request.timeout or 0
        if running is None:
            return DistributedTimeoutError(
                f"timed out after {timeout:g} s (timeout={timeout:g}) before the ranks started on the Ray "
                "cluster (the nodes' warm starters were still importing). No rank ran.",
                still_running=[],
                log_dir=self.log_dir,
            )
        lines = []
        for rank in running:
            tail = self.router.tails[rank].last(5)
            shown = "\n".join(f"      {line}" for line in tail) if tail else "      (nothing printed)"
            lines.append(f"  rank {rank} was still running; its last lines:\n{shown}")
        lines += timeout_section(stacks or {}, self.log_dir)
        return DistributedTimeoutError(
            f"timed out after {timeout:g} s (timeout={timeout:g}); every rank was stopped.\n"
            + "\n".join(lines)
            + f"\n  Logs: {self.log_dir}",
            still_running=running,
            log_dir=self.log_dir,
        )

    def _error_time(self, r: RankRecord) -> float | None:
        if r.error is None:
            return None
        try:
            return float(serialization.loads(r.error).time)
        except Exception:  # noqa: BLE001 - a torn record still says it failed
            return float("-inf")

    def _failure_error(self) -> BaseException:
        failures: list[RankFailure] = []
        collateral: set[int] = set()
        lost: list[RankRecord] = []
        for r in self.ranks:
            if r.state is not RankState.FAILED:
                continue
            clock = self.pool.nodes[r.node]["clock"]
            if r.node_lost:
                lost.append(r)
                continue
            if r.error is not None:
                record = serialization.loads(r.error)
                when = clock + record.time
                if is_collateral(record.type_name, record.message):
                    when += COLLATERAL_S
                    collateral.add(r.rank)
                failures.append(RankFailure(r.rank, when, r.exit_code, record))
            else:
                code = None if r.status_lost else r.exit_code
                when = clock + (r.exit_time if r.exit_time is not None else time.monotonic())
                failures.append(RankFailure(r.rank, when, code, None))
        own = [f for f in failures if f.rank not in collateral]
        if lost and not own:
            return self._lost_error(lost, failures)
        if not failures:
            return LaunchError(f"{self.request.name} failed, but no rank reported why; logs: {self.log_dir}")
        error = build_exception(
            failures,
            world_size=self.world,
            log_path=self.router.log_path,
            last_lines=lambda rank: self.router.tails[rank].last(10),
            cpu_mode=self.request.plan.cpu_mode,
        )
        self.failed_rank = min(failures, key=lambda f: (f.time, f.rank)).rank
        return error

    def _lost_error(self, lost: list[RankRecord], others: list[RankFailure]) -> RankFailedError:
        first = lost[0]
        node = self.pool.nodes[first.node]
        ranks = ", ".join(str(r.rank) for r in lost)
        tail = "\n".join(f"    {line}" for line in self.router.tails[first.rank].last(10)) or "    (nothing)"
        message = (
            f"the Ray node {node['ip']} (node {first.node}) was lost during the call: "
            f"{self.lost_reasons.get(first.node, 'its agent died')}, and rank(s) {ranks} with it "
            "(the node died, its raylet was killed, or the agent was killed). "
            f"Every other rank was stopped.\n  Last lines of rank {first.rank}:\n{tail}\n"
            f"  Logs: {self.log_dir}"
        )
        if others:
            message += f"\n  {len(others)} other rank(s) failed after it (collective errors)."
        self.failed_rank = first.rank
        return RankFailedError(message, rank=first.rank, exit_code=None, log_dir=self.log_dir)


class _RayCells:
    """The Ray backend's CellSender: each node's agent writes to its own ranks' session pipes."""

    def __init__(self, run: RayRun):
        self._run = run

    def send_cell(self, number: int, payload: bytes) -> None:
        run = self._run
        ref = run.ray.put(payload)  # once, whatever the number of nodes
        run.ray.get([a.cell.remote(run.run_id, number, ref) for a in run.agents], timeout=START_WAIT_S)

    def send_stop(self) -> None:
        run = self._run
        try:
            run.ray.get([a.end_session.remote(run.run_id) for a in run.agents], timeout=STACKS_WAIT_S)
        except Exception:  # noqa: BLE001 - a node that cannot answer: the session's stop stops it
            pass

    def interrupt(self, ranks: list[int]) -> None:
        run = self._run
        sent = []
        for node, agent in enumerate(run.agents):
            here = [r.rank for r in run.ranks if r.node == node and r.rank in ranks and not r.exited]
            if here:
                sent.append(agent.interrupt.remote(run.run_id, here))
        try:
            run.ray.get(sent, timeout=STACKS_WAIT_S)
        except Exception as exc:  # noqa: BLE001 - a node that cannot answer: the session ends after the wait
            print(f"air_magic: could not interrupt every node's ranks: {exc}", file=sys.stderr)


def _death_words(r: RankRecord) -> str:
    if r.exit_code == 1:
        return "raised an exception"
    if r.exit_code == 0:
        return "exited with status 0 without a result"
    if r.exit_code is not None and r.exit_code == -signal.SIGKILL:
        return "killed by SIGKILL"
    return exit_words(None if r.status_lost else r.exit_code)


def _actor_died(exc: BaseException) -> bool:
    from ray.exceptions import ActorDiedError

    return isinstance(exc, ActorDiedError)
