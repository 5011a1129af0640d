"""One call's ranks on one node, from the call folder to the last reaped process.

The one rank watcher of both backends: the local backend runs a group in the
caller's thread (``backends/local/local_call.py`` drives :meth:`RankGroup.step`),
a Ray node's agent runs the same class on a thread of its own
(``backends/ray/agent.py``, :meth:`RankGroup.watch_in_thread`). A group

1. makes the call folder (0700, named after this process for the sweep of a dead
   caller's folders): ``launch.json`` and the payload (``protocol/wire.py``);
2. starts its ranks (:meth:`start`): forks of the warm starter when one is ready
   (``warm.py``), else fresh interpreters (``ranks.spawn_rank``), each with
   torchrun's variables for its place (``launch/rank_env.py``), its stdout and
   stderr on pipes and a lifeline whose end kills it when this process dies;
3. watches everything with one selector (no ``select()``: any descriptor number
   works): the pipes, a pidfd per rank (a death wakes it at once), the starter's
   exit reports and a persistent session's answer pipes; and reports each fact
   (``protocol/node_events.py``) to ``emit``: output, an error record, a result,
   an exit (after all the rank's output), new metric lines, a session's answers;
4. deletes the payload (the arguments, in clear) once every rank has read it;
5. stops its ranks when told (:meth:`stop`: a signal, the grace, SIGKILL to each
   process tree, ``process_tree.stop_trees``), and reports their exits.

What the facts mean (how a rank ended, the root cause, the outcome) is decided
once, by the caller's ledger (``launch/ledger.py``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import selectors
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from air_magic import private_files
from air_magic.backends.local import warm
from air_magic.backends.local.ranks import RankPipes, RankSlot, send_signal, spawn_rank
from air_magic.backends.local.session_pipes import SessionPipes
from air_magic.backends.output import ensure_open_files
from air_magic.launch.accelerators import AcceleratorPlan, detect_gpus
from air_magic.launch.rank_env import RankPlace, rank_environment
from air_magic.launch.request import LaunchRequest
from air_magic.launch.stacks import take_stacks
from air_magic.process_tree import DescendantTracker, stop_trees
from air_magic.protocol import env_names, wire
from air_magic.protocol.elastic_error_file import error_file_path, record_from_error_file
from air_magic.protocol.node_events import (
    Answer,
    Exited,
    GroupDone,
    Metrics,
    NodeEvent,
    Output,
    Raised,
    Returned,
)

TICK_S = 0.1  # how often error records, results, metric files and the payload are looked at
DRAIN_S = 2.0  # output still in the pipes after every rank exited (a grandchild may hold them)
FAILURE_GRACE_S = 3.0  # a stop's grace after a failure or a timeout (output is pumped only beyond it)
METRICS_FOLDER = "metrics"


@dataclass(frozen=True)
class GroupSpec:
    """What a node needs to start its ranks of a call (it travels to a Ray node as it is)."""

    run_id: str
    ranks: tuple[int, ...]  # their global ranks, in local-rank order
    plan: AcceleratorPlan  # the call's plan (its world size, CPU or GPU)
    node_rank: int
    master_addr: str
    master_port: int
    log_dir: str  # the call's log folder (on the caller's machine)
    env: dict[str, str] = field(default_factory=dict)  # the call's env=, and the tracking variables
    sys_path: tuple[str, ...] = ()
    argv: tuple[str, ...] = ("",)
    cwd: str = ""
    warm_start: bool = True
    starter_wait_s: float = 0.0  # how long the ranks may wait for the warm starter to become ready
    session: bool = False  # a persistent session: its answer pipes are watched
    by_agent: bool = False  # run by a Ray node's agent: that node's GPUs; metric files shipped
    log_root: str | None = None  # where the warm starter's log goes
    node_count: int = 1  # the nodes of the call (torchrun's GROUP_WORLD_SIZE)

    @classmethod
    def of_call(
        cls,
        request: LaunchRequest,
        *,
        ranks: Iterable[int],
        master: tuple[str, int],
        **where: Any,
    ) -> GroupSpec:
        """The spec of one node's ranks of ``request``, as this process stands now (its sys.path, argv
        and folder); ``where``: the other fields (run_id, log_dir, node_rank, warm_start...)."""
        return cls(
            ranks=tuple(ranks),
            plan=request.plan,
            master_addr=master[0],
            master_port=master[1],
            env=dict(request.env),
            sys_path=tuple(sys.path),
            argv=tuple(sys.argv) or ("",),
            cwd=os.getcwd(),
            session=request.channel is not None,
            **where,
        )

    def rank_environments(
        self, call_dir: str, lifeline_fd: int, metrics_dir: str | None
    ) -> list[dict[str, str]]:
        """Each of this node's ranks' whole environment, in local-rank order."""
        plan, gpus = self.plan, self.plan.gpus
        if self.by_agent and not plan.cpu_mode:  # the GPUs Ray gave this node's agent
            gpus = tuple(detect_gpus())
            plan = replace(plan, gpus=gpus)
        extra = dict(self.env)
        if metrics_dir is not None and env_names.METRICS_DIR in extra:
            extra[env_names.METRICS_DIR] = metrics_dir
        local_world = len(self.ranks)
        return [
            rank_environment(
                place=RankPlace(rank, plan.world_size, local, local_world, self.node_rank, self.node_count),
                plan=plan,
                master_addr=self.master_addr,
                master_port=self.master_port,
                run_id=self.run_id,
                call_dir=call_dir,
                log_dir=self.log_dir,
                lifeline_fd=lifeline_fd,
                extra=extra,
                gpus=gpus,
            )
            for local, rank in enumerate(self.ranks)
        ]


class RankGroup:
    """One call's ranks on this node; every fact about them goes to ``emit`` (any thread)."""

    def __init__(self, spec: GroupSpec, payload: bytes, emit: Callable[[NodeEvent], None]):
        self.spec = spec
        self.run_id = spec.run_id
        self.emit = emit
        ensure_open_files(len(spec.ranks))
        self.call_dir = private_files.private_tempdir(self.run_id)
        self.selector = selectors.DefaultSelector()
        self.session_pipes: SessionPipes | None = None  # a persistent session's line to its ranks here
        self.metrics_dir: str | None = None
        try:
            if spec.by_agent:  # the caller's metrics folder may be on another machine: ours, shipped
                self.metrics_dir = os.path.join(self.call_dir, METRICS_FOLDER)
                os.mkdir(self.metrics_dir, 0o700)
            self._write_call_files(payload)
            if spec.session:
                self.session_pipes = SessionPipes(self.call_dir, spec.ranks)
                for fd in self.session_pipes.open():  # before the ranks start: they open them
                    self.selector.register(fd, selectors.EVENT_READ, ("channel", None))
        except BaseException:
            if self.session_pipes is not None:
                self.session_pipes.close()
            self.selector.close()
            shutil.rmtree(self.call_dir, ignore_errors=True)
            raise
        self.ranks: list[RankSlot] = []
        self.pipes = RankPipes(self.selector, self._output)
        self.tracker = DescendantTracker()
        self.started = False  # the start is over (every rank started, or it ended early)
        self.finished = False  # every rank reaped and its output read
        self.teardown_at: float | None = None  # when the first stop of the ranks began
        self.sigkill_from: float | None = None  # the earliest moment a stop may SIGKILL a rank
        self.ranks_ignore_sigint = False
        self._lifeline_w: int | None = None
        self._held_starter: warm.Starter | None = None
        self._metric_offsets: dict[int, int] = {}
        self._payload_gone = False
        self._raised: set[int] = set()
        self._returned: set[int] = set()
        self._ended: set[int] = set()  # ranks whose exit was reported
        self._reap_lock = threading.Lock()  # a rank's exit is reported once, whoever reaps it
        # The local backend's loop drives it (stop() reaps); a Ray agent's thread watches it (only that
        # thread reaps). Decided here: a stop may come before that thread starts.
        self._in_caller = not spec.by_agent
        self._next_look = 0.0
        self._stop_lock = threading.Lock()
        self._stopping = threading.Event()  # set by stop(): no rank is started after it
        self._thread: threading.Thread | None = None

    def _write_call_files(self, payload: bytes) -> None:
        # The caller's sys.path, as it is. On a Ray node: where it exists there (the same paths on
        # every node is the simple way), then the agent's own (runtime_env's working_dir, py_modules).
        spec = self.spec
        sys_path = list(spec.sys_path)
        if spec.by_agent:
            caller = [p for p in sys_path if p == "" or os.path.isdir(p) or os.path.isfile(p)]
            sys_path = caller + [p for p in sys.path if p not in caller]
        launch = {"sys_path": sys_path, "argv": list(spec.argv) or [""]}
        wire.write_atomically(os.path.join(self.call_dir, wire.LAUNCH_FILE), json.dumps(launch).encode())
        wire.write_atomically(os.path.join(self.call_dir, wire.PAYLOAD_FILE), payload)

    # -- starting ----------------------------------------------------------------------

    def start(
        self,
        give_up: Callable[[], bool] = lambda: False,
        before_ranks: Callable[[warm.Starter | None], None] | None = None,
    ) -> list[tuple[int, int]] | None:
        """Start the ranks: ``[(rank, pid)]``, or None when no rank was started because the wait for
        the warm starter ended with ``give_up()`` true (the call's timeout ran out, or a stop came).
        ``before_ranks(starter)`` runs once the starter is known (None: fresh ranks), before the
        first rank starts (the local call serves its rendezvous store there).
        If a rank cannot be started, the ones already started are stopped (their exits reported)
        and the error is raised."""
        lifeline_r, self._lifeline_w = os.pipe()  # we hold the write end: the ranks die with us
        try:
            return self._start_with(lifeline_r, give_up, before_ranks)
        except BaseException:
            self.stop(0)
            raise
        finally:
            os.close(lifeline_r)
            self.started = True

    def _start_with(
        self,
        lifeline_r: int,
        give_up: Callable[[], bool],
        before_ranks: Callable[[warm.Starter | None], None] | None,
    ) -> list[tuple[int, int]] | None:
        spec = self.spec
        cwd = spec.cwd if os.path.isdir(spec.cwd) else os.getcwd()
        self.ranks_ignore_sigint = warm.sigint_ignored()  # as the ranks will start (exec keeps SIG_IGN)
        envs = spec.rank_environments(self.call_dir, lifeline_r, self.metrics_dir)
        starter = None
        if spec.warm_start and envs:
            starter = self._ready_starter(envs[0], give_up)
            if starter is None and (give_up() or self._stopping.is_set()):
                return None
        if starter is not None:
            # Held: not closed by a rebuild or %distributed restart while its forks run this call;
            # released when every rank is reaped. Its exit reports wake the selector as they come.
            self._held_starter = starter
            self.selector.register(starter, selectors.EVENT_READ, ("starter", None))
        if before_ranks is not None:
            before_ranks(starter)
        started: list[tuple[int, int]] = []
        for rank, env in zip(spec.ranks, envs, strict=True):
            with self._stop_lock:  # a stop either sees this rank, or comes before it is started
                if self._stopping.is_set():
                    break  # stopped while starting: no more ranks
                spawn = functools.partial(spawn_rank, starter, rank, env, cwd, self.call_dir, lifeline_r)
                try:
                    slot = self.pipes.start(rank, spawn)
                except OSError as exc:
                    raise OSError(f"could not start rank {rank} with {sys.executable}: {exc}") from exc
                self.ranks.append(slot)
                started.append((rank, slot.proc.pid))
        return started

    def _ready_starter(self, env: dict[str, str], give_up: Callable[[], bool]) -> warm.Starter | None:
        """The warm starter for ranks with this environment, waited for in slices (a stop is seen
        while it imports), no longer than the spec's wait."""
        end = time.monotonic() + self.spec.starter_wait_s
        startup = warm.startup_environment(env)
        looked_again = False
        while True:
            slice_s = min(TICK_S, max(0.0, end - time.monotonic()))
            starter = warm.get_starter(self.spec.log_root, startup, wait_s=slice_s, hold=True)
            if starter is not None:
                return starter
            coming = warm.starting()
            if coming is None and not looked_again and warm.ready_for(startup):
                # Its ready message came just after that look's wait ran out (under load: the call
                # then started fresh ranks beside a ready starter; test_warm.py): once more. Asked
                # after starting(), which may be what read the message (ready stays ready).
                looked_again = True
                continue
            if coming is None or not warm.serves(startup):
                return None  # none is coming for this call (another call waits for one of its own)
            if self._stopping.is_set() or give_up() or time.monotonic() >= end:
                return None

    # -- watching ----------------------------------------------------------------------

    def running(self) -> bool:  # a rank's exit is not reported yet
        return any(r.rank not in self._ended for r in self.ranks)

    def running_pids(self) -> dict[int, int]:
        """rank -> pid of every rank not yet reaped (from any thread)."""
        return {r.rank: r.proc.pid for r in list(self.ranks) if r.rank not in self._ended}

    def step(self, wait_s: float) -> None:
        """One round: wait up to ``wait_s`` for something (output, a death, an exit report, an answer),
        take it in, and report what changed."""
        for key, _ in self.selector.select(wait_s):
            slot, stream = key.data
            if stream is not None:
                self.pipes.read(key.fd, slot, stream)
            elif slot == "starter":
                self._pump_starter(key.fileobj)
            elif slot == "channel":
                self._answers(key.fd)
            else:
                self._dead(slot)
        self._look()

    def settle(self, wait_s: float = 1.0) -> None:
        """Before teardown: the exit codes of ranks already dead on their own (a warm rank's comes from
        the starter a moment after its death), so that a rank that died first counts as a failure,
        not as one we stopped."""
        end = time.monotonic() + wait_s
        self.step(0)
        while any(r.dead_since is not None and r.rank not in self._ended for r in self.ranks):
            if time.monotonic() >= end:
                return
            self.step(0.005)

    def watch_in_thread(self) -> None:
        """Watch on a thread of this group's own until every rank is reaped, then say so (GroupDone)."""
        self._thread = threading.Thread(target=self._watch, name="air_magic-rank-group", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        try:
            while self.running():
                self.step(TICK_S)
        except Exception:  # noqa: BLE001 - never leave ranks unwatched: stop them, report their exits
            traceback.print_exc()
            self.kill_now()
            for r in self.ranks:
                if r.rank not in self._ended:
                    try:
                        r.proc.wait(timeout=5.0)
                    except Exception:  # noqa: BLE001 - its exit code is lost: SIGKILL was sent
                        pass
                    self._exited(r, lost_code=-signal.SIGKILL)
        finally:
            self.finish()

    def finish(self, drain_s: float = DRAIN_S) -> None:
        """Every rank is reaped: the rest of their output (a grandchild may hold a pipe), the last
        metric lines, then GroupDone."""
        if self.finished:
            return
        try:
            self.pipes.drain(drain_s)
        except Exception:  # noqa: BLE001 - a broken selector: the end must still be said
            traceback.print_exc()
        self._ship_metrics()
        self.finished = True
        self.emit(GroupDone())

    def _dead(self, r: RankSlot) -> None:
        """Its pidfd is readable: the process is gone (a warm rank's exit code comes a moment later)."""
        if r.dead_since is None:
            r.dead_since = time.monotonic()
        self._close_pidfd(r)  # readable for good: watched no more (else the selector would spin)

    def _close_pidfd(self, r: RankSlot) -> None:
        if r.pidfd is not None:
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
            self.emit(Answer(rank, answer, outcome))

    def interrupt(self, ranks: list[int]) -> None:
        """SIGINT to these ranks of a session (a cell's interrupt), skipping any that has ended; the
        interrupt first on their command pipes, for a rank that has not started the cell yet."""
        running = [
            r for r in self.ranks if r.rank in ranks and r.rank not in self._ended and r.dead_since is None
        ]
        if self.session_pipes is not None:
            self.session_pipes.mark_interrupt(r.rank for r in running)
        for r in running:
            send_signal(r, signal.SIGINT)

    def _output(self, rank: int, stream: str, data: bytes) -> None:
        self.emit(Output(rank, stream, data))

    def _pump_starter(self, starter: Any) -> None:
        """Exit reports from the warm starter, as they come: a forked rank's exit waits for no tick."""
        starter.poll(-1)  # stored; the look below reads them
        if not starter.alive():
            self.selector.unregister(starter)

    def _look(self) -> None:
        """Exits now; error records, results, metric lines and the payload every TICK_S."""
        now = time.monotonic()
        files = now >= self._next_look
        if files:
            self._next_look = now + TICK_S
        self.tracker.update(r.proc.pid for r in self.ranks if r.rank not in self._ended)
        for r in self.ranks:
            if r.rank in self._ended:
                continue
            if files:
                self._records_of(r)
            if r.proc.poll() is not None:
                self._exited(r)
        if files:
            self._ship_metrics()
            self._forget_payload_once_loaded()

    def _records_of(self, r: RankSlot) -> None:
        if r.rank not in self._raised:
            data = wire.read_bytes(wire.error_path(self.call_dir, r.rank))
            if data is not None:
                self._raised.add(r.rank)
                self.emit(Raised(r.rank, data))
        if r.rank not in self._returned and os.path.exists(wire.result_path(self.call_dir, r.rank)):
            self._returned.add(r.rank)
            self.emit(Returned(r.rank))

    def _forget_payload_once_loaded(self) -> None:
        """Delete the payload (the arguments, in clear) as soon as every rank has read it."""
        if not self._payload_gone and self.ranks:
            self._payload_gone = forget_payload_once_loaded(self.call_dir, [r.rank for r in self.ranks])

    def _exited(self, r: RankSlot, lost_code: int | None = None) -> None:
        with self._reap_lock:
            if r.rank in self._ended:
                return
            self._ended.add(r.rank)
        code = r.proc.returncode
        r.exit_code = code if code is not None else lost_code
        r.exited_at = r.dead_since if r.dead_since is not None else time.monotonic()
        self._close_pidfd(r)
        self.pipes.drain_rank(r)  # all its output before its exit
        result, returned, error = what_it_left(self.call_dir, r.rank, r.exit_code)
        facts = (r.exit_code, r.exited_at, result, returned, error, r.status_lost)
        self.emit(Exited(r.rank, *facts, self.teardown_at, self.sigkill_from))

    def _ship_metrics(self) -> None:
        """New bytes of each rank's metric file, for the caller's copy (on another node only)."""
        if self.metrics_dir is None:
            return
        for r in self.ranks:
            offset = self._metric_offsets.get(r.rank, 0)
            data = bytes_from(wire.metrics_path(self.metrics_dir, r.rank), offset)
            if data:
                self._metric_offsets[r.rank] = offset + len(data)
                self.emit(Metrics(r.rank, data))

    def stacks(self, why: str = "on request") -> dict[int, str]:
        """Every running rank's thread stacks (launch/stacks.py), from any thread. The ranks write
        signal dumps to the call's log folder, which exists on the caller's node; elsewhere they
        go to the call folder (and only py-spy's reading is sent back)."""
        log_dir = self.spec.log_dir if os.path.isdir(self.spec.log_dir) else self.call_dir
        return take_stacks(self.running_pids(), log_dir, why)

    # -- stopping ----------------------------------------------------------------------

    def stop(self, grace_s: float, ask: int = signal.SIGTERM) -> None:
        """Stop every rank and everything it started: ``ask`` (SIGINT: KeyboardInterrupt, so ``except
        KeyboardInterrupt: save()`` runs), then ``grace_s``, then SIGKILL, as torchrun does. Also
        ranks still being started: none starts after this. Without a watch thread (the local backend)
        the ranks' output is read during a long grace, and their exits are reported here."""
        if ask == signal.SIGINT and self.ranks_ignore_sigint:  # they would wait out the grace
            ask = signal.SIGTERM
        self._stopping.set()
        with self._stop_lock:
            now = time.monotonic()
            self._may_sigkill_from(now + grace_s)  # first: an exit seen meanwhile is judged by both
            if self.teardown_at is None:
                self.teardown_at = now
            # Every rank, also those that ended: their process groups may hold what they started.
            procs = [r.proc for r in self.ranks]
            in_caller = self._in_caller
            if procs:
                long = ask != signal.SIGTERM or grace_s > FAILURE_GRACE_S
                meanwhile = self.pipes.pump if in_caller and long else None
                try:
                    stop_trees(
                        procs,
                        grace_s,
                        self.tracker.seen.values(),
                        ask=signal.Signals(ask),
                        meanwhile=meanwhile,
                    )
                except KeyboardInterrupt:  # a second interrupt: no more grace
                    self._may_sigkill_from(time.monotonic())
                    stop_trees(procs, 0, self.tracker.seen.values())
                    raise
                finally:
                    if in_caller:
                        for r in self.ranks:
                            self._exited(r)  # each once: a rank reported already is skipped

    def kill_now(self) -> None:
        """SIGKILL every rank's group and every descendant seen (no grace: the node is going)."""
        self._stopping.set()
        self._may_sigkill_from(time.monotonic())
        for r in self.ranks:
            with contextlib.suppress(OSError):
                os.killpg(r.proc.pid, signal.SIGKILL)
        for proc in self.tracker.seen.values():
            try:
                proc.kill()
            except Exception:  # noqa: BLE001 - gone already
                pass

    def _may_sigkill_from(self, when: float) -> None:
        """From ``when`` on, a rank that dies by SIGKILL may have been killed by this group."""
        self.sigkill_from = when if self.sigkill_from is None else min(self.sigkill_from, when)

    def close(self) -> None:
        """After the end: the watch thread, the lifeline (last: ranks die with it if anything above
        failed), the starter held, the call folder (the arguments were in it)."""
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.selector.close()
        if self.session_pipes is not None:
            self.session_pipes.close()
        for r in self.ranks:
            if r.pidfd is not None:
                os.close(r.pidfd)
                r.pidfd = None
        if self._lifeline_w is not None:
            os.close(self._lifeline_w)
            self._lifeline_w = None
        if self._held_starter is not None:
            warm.release(self._held_starter)
            self._held_starter = None
        shutil.rmtree(self.call_dir, ignore_errors=True)


# -- the call folder's files of a rank -------------------------------------------------------


def forget_payload_once_loaded(call_dir: str, ranks: list[int]) -> bool:
    """Delete the payload (the arguments, in clear) once every rank has read it; True once gone."""
    if not all(os.path.exists(wire.loaded_path(call_dir, rank)) for rank in ranks):
        return False
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(call_dir, wire.PAYLOAD_FILE))
    return True


def what_it_left(call_dir: str, rank: int, exit_code: int | None) -> tuple[bytes | None, bool, bytes | None]:
    """An ended rank's result (if it exited 0), whether it returned, and its error record: its own
    report, else (exited non-zero by itself) the error file torch's @record wrote."""
    result_path = wire.result_path(call_dir, rank)
    result = wire.read_bytes(result_path) if exit_code == 0 else None
    returned = result is not None or os.path.exists(result_path)
    error = wire.read_bytes(wire.error_path(call_dir, rank))
    if error is None and exit_code is not None and exit_code > 0:
        error = record_from_error_file(error_file_path(call_dir, rank), rank)
    return result, returned, error


def bytes_from(path: str, offset: int) -> bytes:
    """What a file holds past ``offset`` (nothing if it does not exist yet)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read()
    except FileNotFoundError:
        return b""
