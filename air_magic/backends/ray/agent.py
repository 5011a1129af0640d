"""The Ray backend's node agent: one long-lived actor per node, which starts and watches that node's ranks.

The caller (run_loop.py) places one :class:`NodeAgent` on each node of a
call's placement group (placement.py). For a call the agent

1. writes the call folder on its node (0700): ``launch.json`` and the payload,
   which came from the caller's object store once (``ray.put``);
2. starts and watches its ranks with the local backend's own rank group
   (``node/rank_group.py``, on a thread of its own): forks of a warm
   starter that lives in the agent (torch imported once per node, not per
   call), or fresh interpreters, each with torchrun's variables for its place in
   the world and a lifeline whose EOF kills it when the agent dies;
3. keeps the group's facts (``protocol/node_events.py``: output bytes, a reported
   error, an exit with its result or error record, new metric lines) until the
   caller's next :meth:`NodeAgent.poll` takes them (a long poll: it returns as
   soon as there is something, so output reaches the caller in milliseconds and
   is never merged or deduplicated, unlike Ray's ``log_to_driver``);
4. stops its ranks when told (:meth:`NodeAgent.stop`: a signal, grace, SIGKILL to
   every process tree, as the local backend does).

A watchdog thread ends everything when the node's raylet dies (the agent is
re-parented: Ray would leave it running for minutes) or when the caller has not
polled a running call for :data:`CALLER_SILENT_S` (a caller that lost its
network); the kernel then closes the lifelines and every rank dies.

Times in events are this node's ``time.monotonic()``; :meth:`NodeAgent.describe`
gives the offset to the wall clock, so the caller can order failures across nodes.
"""

from __future__ import annotations

import dataclasses
import os
import select
import shutil
import signal
import threading
import time
from dataclasses import asdict
from typing import Any, NoReturn

from air_magic import paths, private_files
from air_magic.launch.accelerators import detect_gpus
from air_magic.node import warm
from air_magic.node.rank_group import GroupSpec, RankGroup
from air_magic.node.rendezvous import RendezvousStore
from air_magic.protocol.node_events import NodeEvent, NodeLost

CALLER_SILENT_S = 30.0  # a running call whose caller stopped polling this long is stopped
WATCHDOG_S = 0.5  # how often the watchdog checks the raylet and the caller


class NodeAgent:
    """Runs on one node (as a Ray actor with ``max_concurrency`` > 2: poll and stop come in parallel)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._events: list[NodeEvent] = []  # of the call self._call_id, until polled
        self._call_id: str | None = None
        self._call: RankGroup | None = None
        self._store: tuple[str, RendezvousStore] | None = None  # (run id, store)
        self._stopped: set[str] = set()  # calls stopped here, perhaps before their start arrived
        self._last_poll = time.monotonic()
        self._parent = os.getppid()  # the raylet; when it dies this process is re-parented
        # An agent killed with its node (SIGKILL) could not remove its call folder: the next agent
        # on this node does (the payload or results of that call, in clear).
        private_files.sweep_dead_callers()
        threading.Thread(target=self._watchdog, name="air_magic-agent-watchdog", daemon=True).start()

    # -- what the caller asks -------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """This node: its address, the GPUs Ray gave this agent (NVML), its clock and its pid."""
        import ray

        context = ray.get_runtime_context()
        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": context.get_node_id(),
            "pid": os.getpid(),
            # Ray set CUDA_VISIBLE_DEVICES to the GPUs of this agent's bundle; NVML honours it.
            "gpus": [asdict(g) for g in detect_gpus()],
            "ray_gpu_ids": [str(i) for i in ray.get_gpu_ids()],
            "clock": time.time() - time.monotonic(),
            "cpus": os.cpu_count() or 1,
        }

    def prestart(self, env: dict[str, str]) -> None:
        """Put this node's warm starter on its way (it imports torch once for every later call)."""
        warm.prestart(self._log_root(), env)

    def open_store(self, call_id: str, world_size: int, host: str) -> int:
        """Host the call's rendezvous store on this node (rank 0's), bound before any rank starts."""
        self._close_store()
        store = RendezvousStore(world_size, host=host)
        self._store = (call_id, store)
        return store.port

    def start(self, spec: GroupSpec, payload: bytes) -> list[tuple[int, int]]:
        """Start this node's ranks of a call; ``[(rank, pid)]`` (empty if the call was stopped first)."""
        call_id = spec.call_id
        with self._cond:
            if call_id in self._stopped:
                return []
            previous, self._call = self._call, None
            self._events.clear()
            self._call_id = call_id
            self._last_poll = time.monotonic()
        if previous is not None:
            # The caller ends each call (finish) before the next; one still here was abandoned
            # (its caller lost): it goes, rather than blocking this node for good. Outside the
            # lock: its watch thread still emits (into nothing: the run id changed) while it ends.
            previous.stop(0)
            previous.close()
        spec = dataclasses.replace(spec, log_root=self._log_root())
        group = RankGroup(spec, payload, lambda event: self._emit(call_id, event))
        with self._cond:
            if call_id in self._stopped:  # stopped while the call folder was written
                group.close()
                return []
            self._call = group
        try:
            return group.start() or []
        finally:
            group.watch_in_thread()  # the exits (of ranks a failed start stopped too), then done
            self._last_poll = time.monotonic()  # a slow start (the starter importing) is not silence

    def poll(self, call_id: str, wait_s: float) -> list[NodeEvent]:
        """The events of call ``call_id`` since the last poll; waits up to ``wait_s`` for the first one.

        A poll of an earlier call (still waiting here when the next call started) gets nothing:
        the events of a call go only to that call's polls.
        """
        with self._cond:
            self._last_poll = time.monotonic()
            if not self._events or self._call_id != call_id:
                self._cond.wait(wait_s)
            if self._call_id != call_id:
                return []
            events, self._events = self._events, []
            self._last_poll = time.monotonic()
        return events

    def stop(self, call_id: str, grace_s: float, signum: int = signal.SIGTERM) -> None:
        """Stop this node's ranks of call ``call_id`` (and everything they started), also ranks it is
        still starting and a start that has not arrived yet; their exits follow as events. They get
        ``signum`` first (SIGINT for a stop, as the local backend sends), then ``grace_s``."""
        with self._cond:
            self._stopped.add(call_id)
            if len(self._stopped) > 64:  # remembered for a late start only; never grows for long
                self._stopped = {call_id}
            call = self._call if self._call is not None and self._call.call_id == call_id else None
        if call is not None:  # (ranks that ignore SIGINT, as a Ray worker may, get SIGTERM: rank_group)
            if grace_s <= 0:  # a second interrupt: a stop still in its grace holds the lock; not this
                call.kill_now()
            call.stop(grace_s, signum)

    def finish(self, call_id: str) -> None:
        """Call ``call_id`` is over: close its store, remove its folder (the arguments were in it)."""
        with self._cond:
            call = self._call if self._call is not None and self._call.call_id == call_id else None
            if call is not None:
                self._call = None
        if call is not None:
            call.stop(0)
            call.close()
        if self._store is not None and self._store[0] == call_id:
            self._close_store()

    def ping(self) -> int:
        return os.getpid()

    # -- a persistent session's cells (SPEC §15; the caller's calls/persistent.py) --------

    def cell(self, call_id: str, number: int, payload: bytes) -> None:
        """Cell ``number`` to this node's ranks of session ``call_id`` (the payload, resolved by Ray)."""
        call = self._call_of(call_id)
        if call is None or call.session_pipes is None:  # the caller must know: its cell runs nowhere here
            raise RuntimeError(f"no session {call_id} on this node (it ended)")
        call.session_pipes.send_cell(number, payload)

    def end_session(self, call_id: str) -> None:
        call = self._call_of(call_id)
        if call is not None and call.session_pipes is not None:
            call.session_pipes.send_stop()

    def interrupt(self, call_id: str, ranks: list[int]) -> None:
        call = self._call_of(call_id)
        if call is not None:
            call.interrupt(ranks)

    def _call_of(self, call_id: str) -> RankGroup | None:
        call = self._call
        return call if call is not None and call.call_id == call_id else None

    def stacks(self, call_id: str) -> dict[int, str]:
        """The thread stacks of this node's running ranks of call ``call_id`` (outcome/stacks.py)."""
        call = self._call_of(call_id)
        return call.stacks() if call is not None else {}

    # -- inside ----------------------------------------------------------------------------

    def _emit(self, call_id: str, event: NodeEvent) -> None:
        with self._cond:
            if call_id == self._call_id:
                self._events.append(event)
                self._cond.notify_all()

    def _close_store(self) -> None:
        if self._store is not None:
            self._store[1].close()
            self._store = None

    @staticmethod
    def _log_root() -> str:
        root = paths.state_dir(paths.RAY_DIR, "agents")
        os.makedirs(root, mode=0o700, exist_ok=True)
        return root

    def _watchdog(self) -> None:
        """The raylet's death wakes this thread at once (a pidfd on it; else a check of the parent
        every WATCHDOG_S); the caller's silence is checked every WATCHDOG_S."""
        raylet_fd = None
        try:
            raylet_fd = os.pidfd_open(self._parent)
        except (AttributeError, OSError):  # an old kernel: the parent check below still works
            raylet_fd = None
        waiter = None
        if raylet_fd is not None:
            waiter = select.poll()  # not select(): any descriptor number works
            waiter.register(raylet_fd, select.POLLIN)
        while True:
            if waiter is not None:
                waiter.poll(WATCHDOG_S * 1000)
            else:
                time.sleep(WATCHDOG_S)
            if os.getppid() != self._parent:
                self._raylet_died()
            call = self._call
            if (
                call is not None
                and call.started
                and not call.finished
                and time.monotonic() - self._last_poll > CALLER_SILENT_S
            ):
                call.stop(0)

    def _raylet_died(self) -> NoReturn:
        """Ray notices only after its health checks (~15 s), and may leave this process running:
        end the ranks now, then this process (their lifelines close with it)."""
        call = self._call
        if call is not None:
            # Said first, so that the caller (reached directly, not through the raylet) can tell
            # the node's death from its ranks' SIGKILLs that follow.
            self._emit(call.call_id, NodeLost("its raylet died"))
            call.kill_now()
            time.sleep(WATCHDOG_S)  # a poll in flight takes the news
            shutil.rmtree(call.call_dir, ignore_errors=True)
        os._exit(1)
