"""One call's ranks on one node, from the call folder to the last reaped process.

The one rank watcher of both backends: the local backend runs a group in the
caller's thread (``backends/local/local_call.py`` drives :meth:`RankGroup.step`),
a Ray node's agent runs the same class on a thread of its own
(``backends/ray/agent.py``, :meth:`RankGroup.watch_in_thread`). A group

1. makes the call folder (0700, named after this process for the sweep of a dead
   caller's folders): ``launch.json`` and the payload (``protocol/wire.py``;
   ``rank_start.write_call_files``);
2. starts its ranks (:meth:`start`, ``rank_start.RankStart``): forks of the warm
   starter when one is ready (``warm.py``), else fresh interpreters
   (``ranks.spawn_rank``), each with torchrun's variables for its place
   (``group_spec.GroupSpec``, ``launch/rank_env.py``), its stdout and stderr on
   pipes and a lifeline whose end kills it when this process dies;
3. watches everything with one selector (``rank_watch.RankWatch``; no ``select()``:
   any descriptor number works): the pipes, a pidfd per rank (a death wakes it at
   once), the starter's exit reports and a persistent session's answer pipes; and
   reports each fact (``protocol/node_events.py``) to ``emit``: output, an error
   record, a result, an exit (after all the rank's output), new metric lines, a
   session's answers;
4. deletes the payload (the arguments, in clear) once every rank has read it (the watch);
5. stops its ranks when told (:meth:`stop`, ``rank_stop.RankStop``: a signal, the
   grace, SIGKILL to each process tree, ``process_tree.stop_trees``), and reports
   their exits.

This class is the face the local call and the Ray agent use; it makes the call
folder and the three parts, and runs the watch thread of a Ray node's group.
What the facts mean (how a rank ended, the root cause, the outcome) is decided
once, by the caller's ledger (``outcome/ledger.py``).
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import threading
import traceback
from collections.abc import Callable

from air_magic import private_files
from air_magic.node import warm
from air_magic.node.group_spec import GroupSpec
from air_magic.node.open_files import ensure_open_files
from air_magic.node.rank_start import RankStart, write_call_files
from air_magic.node.rank_stop import RankStop
from air_magic.node.rank_watch import TICK_S, RankWatch
from air_magic.node.session_pipes import SessionPipes
from air_magic.outcome.stacks import take_stacks
from air_magic.protocol.node_events import NodeEvent

__all__ = ["GroupSpec", "RankGroup"]

METRICS_FOLDER = "metrics"


class RankGroup:
    """One call's ranks on this node; every fact about them goes to ``emit`` (any thread).

    The face of three parts: :class:`~.rank_start.RankStart` (steps 1-2),
    :class:`~.rank_watch.RankWatch` (steps 3-4) and :class:`~.rank_stop.RankStop` (step 5)."""

    def __init__(self, spec: GroupSpec, payload: bytes, emit: Callable[[NodeEvent], None]):
        self.spec = spec
        self.call_id = spec.call_id
        self.emit = emit
        ensure_open_files(len(spec.ranks))
        self.call_dir = private_files.private_tempdir(self.call_id)
        selector = selectors.DefaultSelector()
        self.session_pipes: SessionPipes | None = None  # a persistent session's line to its ranks here
        self.metrics_dir: str | None = None
        try:
            if spec.by_agent:  # the caller's metrics folder may be on another machine: ours, shipped
                self.metrics_dir = os.path.join(self.call_dir, METRICS_FOLDER)
                os.mkdir(self.metrics_dir, 0o700)
            write_call_files(spec, self.call_dir, payload)
            if spec.session:
                self.session_pipes = SessionPipes(self.call_dir, spec.ranks)
                for fd in self.session_pipes.open():  # before the ranks start: they open them
                    selector.register(fd, selectors.EVENT_READ, ("channel", None))
        except BaseException:
            if self.session_pipes is not None:
                self.session_pipes.close()
            selector.close()
            shutil.rmtree(self.call_dir, ignore_errors=True)
            raise
        self.watch = RankWatch(selector, self.call_dir, emit, self.session_pipes, self.metrics_dir)
        self.rank_stop = RankStop(self.watch, in_caller=not spec.by_agent)
        self.rank_start = RankStart(spec, self.call_dir, self.watch, self.rank_stop)
        self.started = False  # the start is over (every rank started, or it ended early)
        self._thread: threading.Thread | None = None

    def start(
        self,
        give_up: Callable[[], bool] = lambda: False,
        before_ranks: Callable[[warm.Starter | None], None] | None = None,
    ) -> list[tuple[int, int]] | None:
        """Start the ranks: ``[(rank, pid)]``, or None if ``give_up()`` ended the wait for the warm
        starter first; ``before_ranks(starter)`` runs just before the first rank starts
        (:meth:`RankStart.start`)."""
        try:
            return self.rank_start.start(give_up, before_ranks)
        finally:
            self.started = True

    # -- watching ----------------------------------------------------------------------

    @property
    def finished(self) -> bool:  # every rank reaped and its output read
        return self.watch.finished

    def running(self) -> bool:  # a rank's exit is not reported yet
        return self.watch.running()

    def running_pids(self) -> dict[int, int]:
        """rank -> pid of every rank not yet reaped (from any thread)."""
        return self.watch.running_pids()

    def step(self, wait_s: float) -> None:
        """One round: wait up to ``wait_s`` for something (output, a death, an exit report, an answer),
        take it in, and report what changed."""
        self.watch.step(wait_s)

    def settle(self, wait_s: float = 1.0) -> None:
        """Before teardown: the exit codes of ranks already dead on their own, so that a rank that
        died first counts as a failure, not as one we stopped (:meth:`RankWatch.settle`)."""
        self.watch.settle(wait_s)

    def watch_in_thread(self) -> None:
        """Watch on a thread of this group's own until every rank is reaped, then say so (GroupDone)."""
        self._thread = threading.Thread(target=self._watch, name="air_magic-rank-group", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        try:
            while self.watch.running():
                self.watch.step(TICK_S)
        except Exception:  # noqa: BLE001 - never leave ranks unwatched: stop them, report their exits
            traceback.print_exc()
            self.rank_stop.kill_now()
            self.watch.reap_killed()
        finally:
            self.watch.finish()

    def finish(self) -> None:
        """Every rank is reaped: the rest of their output (a grandchild may hold a pipe), the last
        metric lines, then GroupDone."""
        self.watch.finish()

    def stacks(self, why: str = "on request") -> dict[int, str]:
        """Every running rank's thread stacks (outcome/stacks.py), from any thread. The ranks write
        signal dumps to the call's log folder, which exists on the caller's node; elsewhere they
        go to the call folder (and only py-spy's reading is sent back)."""
        log_dir = self.spec.log_dir if os.path.isdir(self.spec.log_dir) else self.call_dir
        return take_stacks(self.running_pids(), log_dir, why)

    # -- signals -----------------------------------------------------------------------

    def interrupt(self, ranks: list[int]) -> None:
        """SIGINT to these ranks of a session (a cell's interrupt), skipping any that has ended."""
        self.rank_stop.interrupt(ranks)

    def stop(self, grace_s: float, ask: int = signal.SIGTERM) -> None:
        """Stop every rank and everything it started: ``ask``, then ``grace_s``, then SIGKILL, as
        torchrun does; none starts after this (:meth:`RankStop.stop`)."""
        self.rank_stop.stop(grace_s, ask)

    def kill_now(self) -> None:
        """SIGKILL every rank's group and every descendant seen (no grace: the node is going)."""
        self.rank_stop.kill_now()

    def close(self) -> None:
        """After the end: the watch thread, the selector and pipes, the lifeline (last: ranks die
        with it if anything above failed), the starter held, the call folder (the arguments were
        in it)."""
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.watch.close()
        self.rank_start.close()
        shutil.rmtree(self.call_dir, ignore_errors=True)
