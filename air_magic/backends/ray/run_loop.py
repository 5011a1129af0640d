"""The Ray backend's call, in the caller: the one call loop, on a pool of node agents.

The template (``backends/call_loop.py``) follows the call; this fills in its
hooks for the agents that placement.py reserved::

    ranks numbered node by node (rank 0 on the first node, which hosts the rendezvous store)
    payload put in Ray's object store once; each agent writes it into its node's call folder
    start(): each agent starts its ranks (agent.py: the local backend's rank group) -> RankStarted
    pump(): long polls on every agent at once (ray.wait) -> the groups' facts -> the ledger
    stop(): every agent stops its ranks; their exits are taken in
    finish(): every agent removes its call folder and closes the store

Which failure is the root cause is the ledger's one rule (outcome/failures.py):
across machines, arrival order says little (a rank killed on one node and the
collective error it causes on another arrive within the same poll), so a
rank's own failure comes before the collateral errors of the others, then time
on one clock: each node's monotonic clock turned into wall-clock time with the
offset its agent reported.
"""

from __future__ import annotations

import signal
import sys
import time
from typing import Any

from air_magic.backends.call_loop import TICK_S, CallLoop
from air_magic.backends.ray.placement import Pool
from air_magic.errors import DistributedTimeoutError, LaunchError
from air_magic.launch.request import LaunchRequest, StopRequest
from air_magic.node.rank_group import GroupSpec
from air_magic.protocol.events import EventBus

POLL_S = 0.5  # an agent's long poll returns at once when it has news, else after this
SETTLE_S = 0.5  # after the first failure, news still on its way from other nodes is taken in first
STACKS_WAIT_S = 30.0  # every node's dumps (py-spy takes up to 10 s on a rank that does not answer)
STOP_WAIT_S = 10.0  # after the stop, how long agents get to report their ranks' exits
MAX_POLL_ERRORS = 5  # an agent that fails this many polls in a row (unreachable, not dead) is lost
# A live agent answers every poll within POLL_S. One silent this long is taken for lost: when a
# node dies, Ray may end the agent's process before its watchdog can say so, and tells the
# caller only after its own health checks (12-15 s, measured).
SILENT_AGENT_S = 5.0
START_WAIT_S = 120.0  # agents start ranks in milliseconds; a warm starter may import torch first


class RayCall(CallLoop):
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
        self.pool = pool
        self.agents = pool.agents
        super().__init__(
            request,
            bus,
            stop_requested=stop_requested,
            ranks_per_node=list(pool.shape.counts),
            node_names=[f"the Ray node {node['ip']} (node {i})" for i, node in enumerate(pool.nodes)],
            clocks=[node["clock"] for node in pool.nodes],
            caller_clock=time.time() - time.monotonic(),
        )
        self.warm_start = warm_start
        self.starter_wait_s = starter_wait_s
        self.polls: dict[Any, int] = {}  # outstanding poll -> node
        self.polled_at: dict[int, float] = {}  # node -> when its outstanding poll was sent
        self.side_calls: list[Any] = []  # stop() calls, fetched at the end
        self._started_nodes: set[int] = set()  # nodes whose start() has answered
        self.starts: dict[Any, int] = {}  # outstanding start -> node
        self.poll_errors: dict[int, int] = {}
        self.teardown_at: float | None = None

    # -- starting ------------------------------------------------------------------------

    def start(self) -> bool:
        """Start every rank; False if the timeout or a stop came first (then stop() cleans up).

        Each agent is polled as soon as its ranks are started, not when the slowest node is
        ready: its ranks' output flows, and its watchdog sees a caller that is there.
        """
        ray, nodes = self.ray, self.pool.nodes
        master = nodes[0]["ip"]
        opened = self.agents[0].open_store.remote(self.call_id, self.world, master)
        port = ray.get(opened, timeout=START_WAIT_S)
        payload = ray.put(self.request.payload)  # once, whatever the number of nodes
        if self.request.channel is not None:  # a persistent session: its line, before its ranks answer
            self.request.channel.connect(_RayCells(self))
        wait = self.starter_wait_s
        if self.deadline is not None:
            wait = max(0.0, min(wait, self.deadline - time.monotonic()))
        for node, agent in enumerate(self.agents):
            spec = GroupSpec.of_call(
                self.request,
                call_id=self.call_id,
                log_dir=self.log_dir,
                ranks=[r.rank for r in self.ledger.records if r.node == node],
                node_rank=node,
                node_count=len(self.agents),
                master=(master, port),
                warm_start=self.warm_start,
                starter_wait_s=wait,
                by_agent=True,
            )
            self.starts[agent.start.remote(spec, payload)] = node
        end = time.monotonic() + START_WAIT_S
        while self.starts:
            if self.stop_requested.is_set() or self._deadline_passed():
                return False
            if time.monotonic() > end:
                raise LaunchError(f"the Ray agents did not start the ranks within {START_WAIT_S:g} s")
            self._take_starts(TICK_S)
            self.pump(0.0)  # the nodes already started: their output, and proof of a caller
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
                    self._node_lost(node, "its agent died")
                raise LaunchError(
                    f"could not start the ranks on node {node} ({self.pool.nodes[node]['ip']}): {exc}"
                ) from exc
            finally:
                self._repoll(node)
            for rank, pid in started:
                self.ledger.started(rank, pid)
            self._started_nodes.add(node)
            missing = [r for r in self.ledger.records if r.node == node and r.pid is None]
            if missing and self.teardown_at is None:
                raise LaunchError(
                    f"node {node} ({self.pool.nodes[node]['ip']}) started {len(started)} of its "
                    f"{len(started) + len(missing)} ranks: its agent stopped the call (see its log)"
                )
            if not started:
                self.ledger.done_nodes.add(node)  # nothing ran there: no events will come

    def start_timeout_error(self) -> BaseException:
        timeout = self.request.timeout or 0
        waiting = sorted(set(self.starts.values()))
        nodes = ", ".join(f"node {n} ({self.pool.nodes[n]['ip']})" for n in waiting) or "no node"
        why = "a warm starter still importing" if self.warm_start else "its agent still starting them"
        return DistributedTimeoutError(
            f"timed out after {timeout:g} s (timeout={timeout:g}) before the ranks started on the Ray "
            f"cluster; waiting for: {nodes} ({why}). No rank ran.",
            still_running=[],
            log_dir=self.log_dir,
        )

    # -- following -------------------------------------------------------------------------

    def settle(self) -> None:
        """What other nodes already know (a death, an exception) arrives before the others are stopped."""
        end = time.monotonic() + SETTLE_S
        while self.polls and time.monotonic() < end and not self.ledger.all_exited():
            self.pump(max(0.0, end - time.monotonic()))

    def pump(self, wait_s: float) -> None:
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
                    self._node_lost(node, "its agent died")
                else:
                    self._repoll(node)
                continue
            self.poll_errors[node] = 0
            for event in events:
                self.ledger.take(node, event)
            if self.ledger.lost_nodes:
                self.pool.broken = True  # the next call builds a new pool
            self._repoll(node)

    def _repoll(self, node: int) -> None:
        ledger = self.ledger
        if (
            node not in ledger.done_nodes
            and node not in ledger.lost_nodes
            and node not in self.polls.values()
        ):
            self.polls[self.agents[node].poll.remote(self.call_id, POLL_S)] = node
            self.polled_at[node] = time.monotonic()

    def _silent_agents(self) -> None:
        now = time.monotonic()
        for ref, node in list(self.polls.items()):
            if now - self.polled_at.get(node, now) > POLL_S + SILENT_AGENT_S:
                ready, _ = self.ray.wait([ref], timeout=0)
                if ready:
                    continue  # it answered; the answer is simply not read yet
                del self.polls[ref]
                self._node_lost(node, f"its agent did not answer for {SILENT_AGENT_S:g} s")

    def _node_lost(self, node: int, why: str) -> None:
        self.pool.broken = True  # the next call builds a new pool
        self.ledger.node_lost(node, why)

    # -- stopping --------------------------------------------------------------------------

    def stop(self, grace_s: float, signum: int = signal.SIGTERM) -> None:
        """Every agent stops its ranks of this call (also ranks it is still starting; ``signum``
        first, then ``grace_s``); their exits are taken in, for at most STOP_WAIT_S + grace.
        Returns with every rank accounted for."""
        ledger = self.ledger
        if self.teardown_at is not None and ledger.all_exited() and not self.starts:
            return
        if self.teardown_at is None:
            self.teardown_at = time.monotonic()
            ledger.begin_teardown()
        for agent in self.agents:  # a node taken for lost may only be silent: told too
            self.side_calls.append(agent.stop.remote(self.call_id, grace_s, int(signum)))
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
                    ledger.done_nodes.add(node)  # its start was never sent (an interrupt before)
                if node not in pending and node not in ledger.lost_nodes:
                    # Ranks its agent did not start (the stop came first, or cut its start short):
                    # not lost, so the pool and its warm starters stay for the next call.
                    ledger.never_started(node)
            for node in range(len(self.agents)):
                self._repoll(node)  # a poll lost to an interrupt, say
            while self.polls and time.monotonic() < end:
                if ledger.all_exited() and len(ledger.done_nodes | ledger.lost_nodes) == len(self.agents):
                    break
                self.pump(min(TICK_S, max(0.0, end - time.monotonic())))
        except KeyboardInterrupt:  # a second interrupt: no more grace, on every node
            for agent in self.agents:
                self.side_calls.append(agent.stop.remote(self.call_id, 0.0, int(signal.SIGKILL)))
            end = time.monotonic() + STOP_WAIT_S
            try:
                while self.polls and time.monotonic() < end and not ledger.all_exited():
                    self.pump(min(TICK_S, max(0.0, end - time.monotonic())))
            except KeyboardInterrupt:  # a third: the exits are not waited for
                pass
        for r in ledger.records:
            if not r.exited:  # its agent never answered: counted as lost with its node
                self._node_lost(r.node, "its agent did not report its ranks' exits after the stop")

    def finish(self) -> None:
        """Every live agent closes the store and removes its call folder before the call returns.
        A lost node's agent is told too (it may only have been silent) but not waited for: a
        dead actor's answer comes only after Ray's health checks (measured: 1.4 s of a 1.9 s
        node-loss error went there)."""
        refs = [a.finish.remote(self.call_id) for a in self.agents]
        live = [ref for node, ref in enumerate(refs) if node not in self.ledger.lost_nodes]
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

    def stacks(self) -> dict[int, str]:
        """Every running rank's thread stacks, each node's agent taking its own (from any thread)."""
        return agents_stacks(self.ray, self.agents, self.call_id)


def agents_stacks(ray: Any, agents: list[Any], call_id: str) -> dict[int, str]:
    """The thread stacks of call ``call_id``'s running ranks, each node's agent taking its own: for
    the caller, and for ``job_stacks`` (another driver of the cluster, asking a Ray job's agents)."""
    found: dict[int, str] = {}
    try:
        parts = ray.get([agent.stacks.remote(call_id) for agent in agents], timeout=STACKS_WAIT_S)
    except Exception:  # noqa: BLE001 - stacks are a help; a node that cannot answer gives none
        return found
    for part in parts:
        found.update(part)
    return found


class _RayCells:
    """The Ray backend's CellSender: each node's agent writes to its own ranks' session pipes."""

    def __init__(self, run: RayCall):
        self._run = run

    def send_cell(self, number: int, payload: bytes) -> None:
        run = self._run
        ref = run.ray.put(payload)  # once, whatever the number of nodes
        run.ray.get([a.cell.remote(run.call_id, number, ref) for a in run.agents], timeout=START_WAIT_S)

    def send_stop(self) -> None:
        run = self._run
        try:
            run.ray.get([a.end_session.remote(run.call_id) for a in run.agents], timeout=STACKS_WAIT_S)
        except Exception:  # noqa: BLE001 - a node that cannot answer: the session's stop stops it
            pass

    def interrupt(self, ranks: list[int]) -> None:
        run = self._run
        sent = []
        for node, agent in enumerate(run.agents):
            here = [r.rank for r in run.ledger.records if r.node == node and r.rank in ranks and not r.exited]
            if here:
                sent.append(agent.interrupt.remote(run.call_id, here))
        try:
            run.ray.get(sent, timeout=STACKS_WAIT_S)
        except Exception as exc:  # noqa: BLE001 - a node that cannot answer: the session ends after the wait
            print(f"air_magic: could not interrupt every node's ranks: {exc}", file=sys.stderr)


def _actor_died(exc: BaseException) -> bool:
    from ray.exceptions import ActorDiedError

    return isinstance(exc, ActorDiedError)
