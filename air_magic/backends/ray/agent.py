"""The Ray backend's node agent: one long-lived actor per node, which starts and watches that node's ranks.

The caller (run_loop.py) places one :class:`NodeAgent` on each node of a
call's placement group (placement.py). For a call the agent

1. writes the call folder on its node (0700): ``launch.json`` and the payload,
   which came from the caller's object store once (``ray.put``);
2. starts its ranks exactly as the local backend does: forks of a warm starter
   that lives in the agent (torch imported once per node, not per call), or
   fresh interpreters; each with torchrun's variables for its place in the
   world (launch/rank_env.py), its stdout and stderr on pipes, and a lifeline
   whose EOF kills it when the agent dies (worker/entry.py);
3. watches them with one thread (a selector over pipes and pidfds) and keeps
   what happens as events — output bytes, a reported error, an exit with its
   result or error record, new metric lines — until the caller's next
   :meth:`NodeAgent.poll` takes them (a long poll: it returns as soon as there
   is something, so output reaches the caller in milliseconds and is never
   merged or deduplicated, unlike Ray's ``log_to_driver``);
4. stops its ranks when told (:meth:`NodeAgent.stop`: SIGTERM, grace, SIGKILL to
   every process tree, as ``process_tree.stop_trees`` does locally).

A watchdog thread ends everything when the node's raylet dies (the agent is
re-parented: Ray would leave it running for minutes) or when the caller has not
polled a running call for :data:`CALLER_SILENT_S` (a caller that lost its
network); the kernel then closes the lifelines and every rank dies.

Times in events are this node's ``time.monotonic()``; :meth:`NodeAgent.describe`
gives the offset to the wall clock, so the caller can order failures across nodes.
"""

from __future__ import annotations

import functools
import json
import os
import select
import selectors
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import asdict
from typing import Any, NoReturn, cast

from air_magic import paths, private_files
from air_magic.backends.local import warm
from air_magic.backends.local.ranks import RankPipes, RankSlot, send_signal, spawn_rank
from air_magic.backends.local.rendezvous import RendezvousStore
from air_magic.backends.local.session_pipes import SessionPipes
from air_magic.launch.accelerators import AcceleratorPlan, detect_gpus
from air_magic.launch.rank_env import RankPlace, rank_environment
from air_magic.launch.stacks import take_stacks
from air_magic.process_tree import DescendantTracker, stop_trees
from air_magic.protocol import env_names, wire

TICK_S = 0.1  # how often the watch thread looks at exit codes, error records and metric files
CALLER_SILENT_S = 30.0  # a running call whose caller stopped polling this long is stopped
WATCHDOG_S = 0.5  # how often the watchdog checks the raylet and the caller
_DRAIN_S = 2.0  # output still in the pipes after every rank exited (a grandchild may hold them)
METRICS_FOLDER = "metrics"


class NodeAgent:
    """Runs on one node (as a Ray actor with ``max_concurrency`` > 2: poll and stop come in parallel)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._events: list[tuple[Any, ...]] = []  # of the call self._run_id, until polled
        self._run_id: str | None = None
        self._call: NodeCall | None = None
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

    def open_store(self, run_id: str, world_size: int, host: str) -> int:
        """Host the call's rendezvous store on this node (rank 0's), bound before any rank starts."""
        self._close_store()
        store = RendezvousStore(world_size, host=host)
        self._store = (run_id, store)
        return store.port

    def start(self, spec: dict[str, Any], payload: bytes) -> list[tuple[int, int]]:
        """Start this node's ranks of a call; ``[(rank, pid)]`` (empty if the call was stopped first)."""
        run_id = spec["run_id"]
        with self._cond:
            if run_id in self._stopped:
                return []
            previous, self._call = self._call, None
            self._events.clear()
            self._run_id = run_id
            self._last_poll = time.monotonic()
        if previous is not None:
            # The caller ends each call (finish) before the next; one still here was abandoned
            # (its caller lost): it goes, rather than blocking this node for good. Outside the
            # lock: its watch thread still emits (into nothing: the run id changed) while it ends.
            previous.stop(0)
            previous.close()
        call = NodeCall(spec, payload, self._emit, self._log_root())
        with self._cond:
            if run_id in self._stopped:  # stopped while the call folder was written
                call.close()
                return []
            self._call = call
        try:
            return call.start()
        finally:
            self._last_poll = time.monotonic()  # a slow start (the starter importing) is not silence

    def poll(self, run_id: str, wait_s: float) -> list[tuple[Any, ...]]:
        """The events of call ``run_id`` since the last poll; waits up to ``wait_s`` for the first one.

        A poll of an earlier call (still waiting here when the next call started) gets nothing:
        the events of a call go only to that call's polls.
        """
        with self._cond:
            self._last_poll = time.monotonic()
            if not self._events or self._run_id != run_id:
                self._cond.wait(wait_s)
            if self._run_id != run_id:
                return []
            events, self._events = self._events, []
            self._last_poll = time.monotonic()
        return events

    def stop(self, run_id: str, grace_s: float, signum: int = signal.SIGTERM) -> None:
        """Stop this node's ranks of call ``run_id`` (and everything they started), also ranks it is
        still starting and a start that has not arrived yet; their exits follow as events. They get
        ``signum`` first (SIGINT for a stop, as the local backend sends), then ``grace_s``."""
        with self._cond:
            self._stopped.add(run_id)
            if len(self._stopped) > 64:  # remembered for a late start only; never grows for long
                self._stopped = {run_id}
            call = self._call if self._call is not None and self._call.run_id == run_id else None
        if signum == signal.SIGINT and warm.sigint_ignored():  # so do the ranks it starts: they would
            signum = signal.SIGTERM  # wait out the grace (a Ray worker may ignore SIGINT)
        if call is not None:
            if grace_s <= 0:  # a second interrupt: a stop still in its grace holds the lock; not this
                call.kill_now()
            call.stop(grace_s, signal.Signals(signum))

    def finish(self, run_id: str) -> None:
        """Call ``run_id`` is over: close its store, remove its folder (the arguments were in it)."""
        with self._cond:
            call = self._call if self._call is not None and self._call.run_id == run_id else None
            if call is not None:
                self._call = None
        if call is not None:
            call.stop(0)
            call.close()
        if self._store is not None and self._store[0] == run_id:
            self._close_store()

    def ping(self) -> int:
        return os.getpid()

    # -- a persistent session's cells (SPEC §15; the caller's session/persistent.py) --------

    def cell(self, run_id: str, number: int, payload: bytes) -> None:
        """Cell ``number`` to this node's ranks of session ``run_id`` (the payload, resolved by Ray)."""
        call = self._call_of(run_id)
        if call is None or call.session_pipes is None:  # the caller must know: its cell runs nowhere here
            raise RuntimeError(f"no session {run_id} on this node (it ended)")
        call.session_pipes.send_cell(number, payload)

    def end_session(self, run_id: str) -> None:
        call = self._call_of(run_id)
        if call is not None and call.session_pipes is not None:
            call.session_pipes.send_stop()

    def interrupt(self, run_id: str, ranks: list[int]) -> None:
        call = self._call_of(run_id)
        if call is not None:
            call.interrupt(ranks)

    def _call_of(self, run_id: str) -> NodeCall | None:
        call = self._call
        return call if call is not None and call.run_id == run_id else None

    def stacks(self, run_id: str) -> dict[int, str]:
        """The thread stacks of this node's running ranks of call ``run_id`` (launch/stacks.py)."""
        call = self._call
        if call is None or call.run_id != run_id:
            return {}
        pids = {r.rank: r.proc.pid for r in list(call.ranks) if r.exit_code is None}
        # The ranks write signal dumps to the call's log folder path, which exists on the
        # caller's node; elsewhere only py-spy can read them (and the dump is kept here).
        log_dir = call.spec["log_dir"] if os.path.isdir(call.spec["log_dir"]) else call.run_dir
        return take_stacks(pids, log_dir)

    # -- inside ----------------------------------------------------------------------------

    def _emit(self, run_id: str, event: tuple[Any, ...]) -> None:
        with self._cond:
            if run_id == self._run_id:
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
        while True:
            if raylet_fd is not None:
                select.select([raylet_fd], [], [], WATCHDOG_S)
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
            self._emit(call.run_id, ("lost", "its raylet died"))
            call.kill_now()
            time.sleep(WATCHDOG_S)  # a poll in flight takes the news
            shutil.rmtree(call.run_dir, ignore_errors=True)
        os._exit(1)


class NodeCall:
    """One call's ranks on this node, from the call folder to the last exit event."""

    def __init__(self, spec: dict[str, Any], payload: bytes, emit: Any, log_root: str):
        self.spec = spec
        self.run_id: str = spec["run_id"]
        self.emit = functools.partial(emit, self.run_id)
        self.log_root = log_root
        self.run_dir = private_files.private_tempdir(self.run_id)
        self.selector = selectors.DefaultSelector()
        self.session_pipes: SessionPipes | None = None  # a persistent session's line to its ranks here
        try:
            self.metrics_dir = os.path.join(self.run_dir, METRICS_FOLDER)
            os.mkdir(self.metrics_dir, 0o700)
            self._write_call_files(payload)
            if spec.get("session"):
                self.session_pipes = SessionPipes(self.run_dir, spec["ranks"])
                for fd in self.session_pipes.open():  # before the ranks start: they open them
                    self.selector.register(fd, selectors.EVENT_READ, ("channel", None))
        except BaseException:
            if self.session_pipes is not None:
                self.session_pipes.close()
            self.selector.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)
            raise
        self.started = False  # every rank is started (or the start ended): the watchdog may act
        self.ranks: list[RankSlot] = []
        self.pipes = RankPipes(self.selector, self._output)
        self.tracker = DescendantTracker()
        self.lifeline_w: int | None = None
        self.finished = False
        self.teardown_at: float | None = None
        self._metric_offsets: dict[int, int] = {}
        self._payload_gone = False
        self._raised: set[int] = set()
        self._stop_lock = threading.Lock()
        self._stopping = threading.Event()  # set by stop(): no rank is started after it
        self._thread: threading.Thread | None = None

    def _write_call_files(self, payload: bytes) -> None:
        # The caller's sys.path where it exists on this node (the same paths on every node is
        # the simple way), then this worker's own (runtime_env's working_dir and py_modules).
        caller = [p for p in self.spec["sys_path"] if p == "" or os.path.isdir(p) or os.path.isfile(p)]
        sys_path = caller + [p for p in sys.path if p not in caller]
        launch = {"sys_path": sys_path, "argv": self.spec["argv"]}
        wire.write_atomically(os.path.join(self.run_dir, wire.LAUNCH_FILE), json.dumps(launch).encode())
        wire.write_atomically(os.path.join(self.run_dir, wire.PAYLOAD_FILE), payload)

    # -- starting ----------------------------------------------------------------------------

    def start(self) -> list[tuple[int, int]]:
        """Start the ranks and the watch thread. If a rank cannot be started, the ones already
        started are stopped and reported, and the error goes to the caller."""
        try:
            return self._start()
        except BaseException:
            self.stop(0)
            if self._thread is None:  # the watch thread reports the exits, then "done"
                self._thread = threading.Thread(target=self._watch, name="air_magic-agent-watch", daemon=True)
                self._thread.start()
            raise

    def _start(self) -> list[tuple[int, int]]:
        try:
            return self._start_ranks()
        finally:
            self.started = True

    def _start_ranks(self) -> list[tuple[int, int]]:
        lifeline_r, self.lifeline_w = os.pipe()  # the agent holds the write end: ranks die with it
        try:
            return self._start_with(lifeline_r)
        finally:
            os.close(lifeline_r)

    def _start_with(self, lifeline_r: int) -> list[tuple[int, int]]:
        spec = self.spec
        cwd = spec["cwd"] if os.path.isdir(spec["cwd"]) else os.getcwd()
        gpus = tuple(detect_gpus()) if not spec["cpu_mode"] else ()
        plan = AcceleratorPlan(world_size=spec["world_size"], gpus=gpus, detected=spec["detected"])
        extra = dict(spec["env"])
        if env_names.METRICS_DIR in extra:  # the caller's folder may be on another machine
            extra[env_names.METRICS_DIR] = self.metrics_dir
        envs = [
            rank_environment(
                place=RankPlace(
                    rank=rank,
                    world_size=spec["world_size"],
                    local_rank=local_rank,
                    local_world_size=len(spec["ranks"]),
                    node_rank=spec["node_rank"],
                ),
                plan=plan,
                master_addr=spec["master_addr"],
                master_port=spec["master_port"],
                run_id=self.run_id,
                run_dir=self.run_dir,
                log_dir=spec["log_dir"],
                lifeline_fd=lifeline_r,
                extra=extra,
                gpus=gpus,
            )
            for local_rank, rank in enumerate(spec["ranks"])
        ]
        starter = self._ready_starter(envs[0]) if spec["warm_start"] and envs else None
        if starter is not None:  # its exit reports wake the watch thread as soon as they come
            self.selector.register(starter, selectors.EVENT_READ, ("starter", None))
        started: list[tuple[int, int]] = []
        for rank, env in zip(spec["ranks"], envs, strict=True):
            with self._stop_lock:  # a stop either sees this rank, or comes before it is started
                if self._stopping.is_set():
                    break  # stopped while starting: no more ranks
                started.append(self._start_rank(starter, rank, env, cwd, lifeline_r))
        self._thread = threading.Thread(target=self._watch, name="air_magic-agent-watch", daemon=True)
        self._thread.start()
        return started

    def _ready_starter(self, env: dict[str, str]) -> warm.Starter | None:
        """This node's warm starter, waited for in slices so that a stop is seen while it imports."""
        end = time.monotonic() + float(self.spec.get("starter_wait_s", 0.0))
        startup = warm.startup_environment(env)
        while True:
            slice_s = min(TICK_S, max(0.0, end - time.monotonic()))
            starter = warm.get_starter(self.log_root, startup, wait_s=slice_s)
            if starter is not None or warm.starting() is None:
                return starter
            if self._stopping.is_set() or time.monotonic() >= end:
                return None

    def _start_rank(
        self, starter: warm.Starter | None, rank: int, env: dict[str, str], cwd: str, lifeline_r: int
    ) -> tuple[int, int]:
        """One rank, forked or fresh, watched by this call's selector."""
        spawn = functools.partial(spawn_rank, starter, rank, env, cwd, self.run_dir, lifeline_r)
        slot = self.pipes.start(rank, spawn)
        self.ranks.append(slot)
        return rank, slot.proc.pid

    # -- watching ----------------------------------------------------------------------------

    def _watch(self) -> None:
        try:
            while any(r.exit_code is None for r in self.ranks):
                for key, _ in self.selector.select(TICK_S):
                    slot, stream = key.data
                    if stream is not None:
                        self.pipes.read(key.fd, slot, stream)
                    elif slot == "starter":
                        self._pump_starter(cast(warm.Starter, key.fileobj))
                    elif slot == "channel":
                        self._answers(key.fd)
                    else:
                        self._dead(slot)
                self._look()
        except Exception:  # noqa: BLE001 - never leave ranks unwatched: stop them, report their exits
            traceback.print_exc()
            self.kill_now()
            for r in self.ranks:
                if r.exit_code is None:
                    try:
                        r.proc.wait(timeout=5.0)
                    except Exception:  # noqa: BLE001 - its exit code is lost: SIGKILL was sent
                        pass
                    self._exited(r, -signal.SIGKILL)
        finally:
            try:
                self.pipes.drain(_DRAIN_S)  # the rest of the output; the pipes closed (the agent lives on)
            except Exception:  # noqa: BLE001 - a broken selector: the exits and "done" must still go out
                traceback.print_exc()
            self._ship_metrics()
            self.finished = True
            self.emit(("done",))

    def _dead(self, r: RankSlot) -> None:
        """Its pidfd is readable: the process is gone (a warm rank's exit code comes a moment later)."""
        if r.dead_since is None:
            r.dead_since = time.monotonic()
        if r.pidfd is not None:  # readable for good: watched no more (else the select would spin)
            self.selector.unregister(r.pidfd)
            os.close(r.pidfd)
            r.pidfd = None

    def _answers(self, fd: int) -> None:
        """A session rank's answers, each after everything that rank printed before it."""
        assert self.session_pipes is not None
        for rank, answer, outcome in self.session_pipes.read(fd):
            for r in self.ranks:
                if r.rank == rank:
                    self.pipes.drain_rank(r)
            self.emit(("answer", rank, answer, outcome))

    def interrupt(self, ranks: list[int]) -> None:
        """SIGINT to these ranks of a session (a cell's interrupt), skipping any that has ended."""
        for r in list(self.ranks):
            if r.rank in ranks and r.exit_code is None and r.dead_since is None:
                send_signal(r, signal.SIGINT)

    def _output(self, rank: int, stream: str, data: bytes) -> None:
        self.emit(("out", rank, stream, data))

    def _pump_starter(self, starter: warm.Starter) -> None:
        """Exit reports from the warm starter, as they come: a forked rank's exit waits for no tick."""
        starter.poll(-1)
        if not starter.alive():
            self.selector.unregister(starter)

    def _look(self) -> None:
        """Exit codes, newly reported errors, new metric lines."""
        self.tracker.update(r.proc.pid for r in self.ranks if r.exit_code is None)
        for r in self.ranks:
            if r.exit_code is not None:
                continue
            if r.rank not in self._raised:
                data = wire.read_bytes(wire.error_path(self.run_dir, r.rank))
                if data is not None:
                    self._raised.add(r.rank)
                    self.emit(("raised", r.rank, data))
            if r.proc.poll() is not None:
                self._exited(r)
        self._ship_metrics()
        if not self._payload_gone and all(
            os.path.exists(wire.loaded_path(self.run_dir, r.rank)) for r in self.ranks
        ):
            self._payload_gone = True  # every rank has it: the arguments, in clear, are deleted
            try:
                os.unlink(os.path.join(self.run_dir, wire.PAYLOAD_FILE))
            except OSError:
                pass

    def _exited(self, r: RankSlot, lost_code: int | None = None) -> None:
        code = r.proc.returncode
        r.exit_code = code if code is not None else lost_code
        r.exited_at = r.dead_since if r.dead_since is not None else time.monotonic()
        if r.pidfd is not None:
            self.selector.unregister(r.pidfd)
            os.close(r.pidfd)
            r.pidfd = None
        self.pipes.drain_rank(r)  # all its output before its exit
        result = wire.read_bytes(wire.result_path(self.run_dir, r.rank)) if r.exit_code == 0 else None
        error = wire.read_bytes(wire.error_path(self.run_dir, r.rank))
        self.emit(("exit", r.rank, r.exit_code, r.exited_at, result, error, r.status_lost, self.teardown_at))

    def _ship_metrics(self) -> None:
        """New bytes of each rank's metric file, to be appended to the caller's copy."""
        for r in self.ranks:
            path = wire.metrics_path(self.metrics_dir, r.rank)
            offset = self._metric_offsets.get(r.rank, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except FileNotFoundError:
                continue
            if data:
                self._metric_offsets[r.rank] = offset + len(data)
                self.emit(("metrics", r.rank, data))

    # -- stopping ----------------------------------------------------------------------------

    def stop(self, grace_s: float, ask: signal.Signals = signal.SIGTERM) -> None:
        self._stopping.set()
        with self._stop_lock:
            if self.teardown_at is None:
                self.teardown_at = time.monotonic()
            procs = [r.proc for r in self.ranks]
            if procs:
                stop_trees(procs, grace_s, self.tracker.seen.values(), ask=ask)

    def kill_now(self) -> None:
        """SIGKILL every rank's group and every descendant seen (no grace: the node is going)."""
        self._stopping.set()
        for r in self.ranks:
            try:
                os.killpg(r.proc.pid, signal.SIGKILL)
            except OSError:
                pass
        for proc in self.tracker.seen.values():
            try:
                proc.kill()
            except Exception:  # noqa: BLE001 - gone already
                pass

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self.lifeline_w is not None:
            os.close(self.lifeline_w)
            self.lifeline_w = None
        self.selector.close()
        if self.session_pipes is not None:
            self.session_pipes.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)
