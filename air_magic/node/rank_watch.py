"""Step 3 of a rank group (``rank_group.py``): one selector over everything its ranks do.

The watch holds the group's rank slots (``rank_start.py`` adds each as it
starts) and waits on all of them at once with a selector (no ``select()``: any
descriptor number works): each rank's stdout and stderr pipes, a pidfd per rank
(a death wakes it at once), the warm starter's exit reports and a persistent
session's answer pipes. Each fact goes to ``emit`` as it is seen
(``protocol/node_events.py``): output, an error record, a result, an exit (after
all the rank's output, stamped with the stop's marks that ``rank_stop.py`` set),
new metric lines, a session's answers. Every ``TICK_S`` it also looks at the
call folder's files, and deletes the payload (the arguments, in clear) once
every rank has read it (step 4). The local backend drives it in the caller's
thread (:meth:`RankWatch.step`); a Ray agent's group runs the same steps on a
thread of its own.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from air_magic.node.ranks import ForkedRank, FreshRank, RankPipes, RankSlot
from air_magic.node.session_pipes import SessionPipes
from air_magic.process_tree import DescendantTracker
from air_magic.protocol import wire
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


class RankWatch:
    """The ranks of one group as they run: every fact about them goes to ``emit`` (any thread)."""

    def __init__(
        self,
        selector: selectors.BaseSelector,
        call_dir: str,
        emit: Callable[[NodeEvent], None],
        session_pipes: SessionPipes | None,
        metrics_dir: str | None,
    ):
        self.selector = selector
        self.call_dir = call_dir
        self.emit = emit
        self.session_pipes = session_pipes  # its answer pipes are in the selector already
        self.metrics_dir = metrics_dir  # only where the caller cannot read the metric files: shipped
        self.ranks: list[RankSlot] = []
        self.pipes = RankPipes(selector, self._output)
        self.tracker = DescendantTracker()
        self.ended: set[int] = set()  # ranks whose exit was reported
        self.finished = False  # every rank reaped and its output read
        self.teardown_at: float | None = None  # when the first stop of the ranks began
        self.sigkill_from: float | None = None  # the earliest moment a stop may SIGKILL a rank
        self._metric_offsets: dict[int, int] = {}
        self._payload_gone = False
        self._raised: set[int] = set()
        self._returned: set[int] = set()
        self._reap_lock = threading.Lock()  # a rank's exit is reported once, whoever reaps it
        self._next_look = 0.0

    # -- what is watched -------------------------------------------------------------------

    def start_rank(
        self, rank: int, spawn: Callable[[int, int, int, int], FreshRank | ForkedRank]
    ) -> RankSlot:
        """Start a rank through ``spawn`` (``RankPipes.start``) and watch its pipes and pidfd."""
        slot = self.pipes.start(rank, spawn)
        self.ranks.append(slot)
        return slot

    def watch_starter(self, starter: Any) -> None:
        """The warm starter's exit reports wake the selector as they come."""
        self.selector.register(starter, selectors.EVENT_READ, ("starter", None))

    def running(self) -> bool:  # a rank's exit is not reported yet
        return any(r.rank not in self.ended for r in self.ranks)

    def running_pids(self) -> dict[int, int]:
        """rank -> pid of every rank not yet reaped (from any thread)."""
        return {r.rank: r.proc.pid for r in list(self.ranks) if r.rank not in self.ended}

    # -- the rounds ------------------------------------------------------------------------

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
        while any(r.dead_since is not None and r.rank not in self.ended for r in self.ranks):
            if time.monotonic() >= end:
                return
            self.step(0.005)

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

    def reap_killed(self) -> None:
        """Every rank was sent SIGKILL (the watch broke): wait for each one not reported yet, and
        report its exit (its code lost: SIGKILL)."""
        for r in self.ranks:
            if r.rank not in self.ended:
                try:
                    r.proc.wait(timeout=5.0)
                except Exception:  # noqa: BLE001 - its exit code is lost: SIGKILL was sent
                    pass
                self.exited(r, lost_code=-signal.SIGKILL)

    # -- the stop's marks, said with every exit ----------------------------------------------

    def teardown_begins(self, now: float, sigkill_from: float) -> None:
        """A stop began at ``now``; it may SIGKILL from ``sigkill_from`` (the earliest stop counts)."""
        self.may_sigkill_from(sigkill_from)  # first: an exit seen meanwhile is judged by both
        if self.teardown_at is None:
            self.teardown_at = now

    def may_sigkill_from(self, when: float) -> None:
        """From ``when`` on, a rank that dies by SIGKILL may have been killed by this group."""
        self.sigkill_from = when if self.sigkill_from is None else min(self.sigkill_from, when)

    # -- each fact -------------------------------------------------------------------------

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
        self.tracker.update(r.proc.pid for r in self.ranks if r.rank not in self.ended)
        for r in self.ranks:
            if r.rank in self.ended:
                continue
            if files:
                self._records_of(r)
            if r.proc.poll() is not None:
                self.exited(r)
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

    def exited(self, r: RankSlot, lost_code: int | None = None) -> None:
        """Report the rank's exit, once (whoever reaps it), after all its output."""
        with self._reap_lock:
            if r.rank in self.ended:
                return
            self.ended.add(r.rank)
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

    def close(self) -> None:
        """After the end: the selector, the session's pipes and any pidfd still open."""
        self.selector.close()
        if self.session_pipes is not None:
            self.session_pipes.close()
        for r in self.ranks:
            if r.pidfd is not None:
                os.close(r.pidfd)
                r.pidfd = None


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
