"""Step 5 of a rank group (``rank_group.py``): the signals it sends its ranks.

A stop (:meth:`RankStop.stop`) marks the teardown on the watch (``rank_watch.py``:
every exit from then on says when it began and when a SIGKILL could come, so that
the caller's ledger tells a rank we stopped from one that died on its own), then
stops every rank's process tree as torchrun does: a signal, the grace, SIGKILL
(``process_tree.stop_trees``). Once a stop has begun no rank is started
(``rank_start.py`` starts each under the same lock). Also here: SIGKILL at once
when the node is going, and a session cell's interrupt.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from air_magic.node.rank_watch import RankWatch
from air_magic.node.ranks import send_signal
from air_magic.process_tree import stop_trees

FAILURE_GRACE_S = 3.0  # a stop's grace after a failure or a timeout (output is pumped only beyond it)


class RankStop:
    """How a group's ranks are signalled: stopped, killed, interrupted (from any thread)."""

    def __init__(self, watch: RankWatch, in_caller: bool):
        self.watch = watch
        # The local backend's loop drives the group (stop() reaps); a Ray agent's thread watches it
        # (only that thread reaps). Decided when the group is made: a stop may come before that
        # thread starts.
        self.in_caller = in_caller
        self.lock = threading.Lock()  # held while a rank starts: a stop sees it, or comes before it
        self.stopping = threading.Event()  # set by a stop: no rank is started after it
        self.ranks_ignore_sigint = False  # set as the ranks start (exec keeps SIG_IGN)

    def stop(self, grace_s: float, ask: int = signal.SIGTERM) -> None:
        """Stop every rank and everything it started: ``ask`` (SIGINT: KeyboardInterrupt, so ``except
        KeyboardInterrupt: save()`` runs), then ``grace_s``, then SIGKILL, as torchrun does. Also
        ranks still being started: none starts after this. Without a watch thread (the local backend)
        the ranks' output is read during a long grace, and their exits are reported here."""
        if ask == signal.SIGINT and self.ranks_ignore_sigint:  # they would wait out the grace
            ask = signal.SIGTERM
        self.stopping.set()
        watch = self.watch
        with self.lock:
            now = time.monotonic()
            watch.teardown_begins(now, now + grace_s)
            # Every rank, also those that ended: their process groups may hold what they started.
            procs = [r.proc for r in watch.ranks]
            in_caller = self.in_caller
            if procs:
                long = ask != signal.SIGTERM or grace_s > FAILURE_GRACE_S
                meanwhile = watch.pipes.pump if in_caller and long else None
                try:
                    stop_trees(
                        procs,
                        grace_s,
                        watch.tracker.seen.values(),
                        ask=signal.Signals(ask),
                        meanwhile=meanwhile,
                    )
                except KeyboardInterrupt:  # a second interrupt: no more grace
                    watch.may_sigkill_from(time.monotonic())
                    stop_trees(procs, 0, watch.tracker.seen.values())
                    raise
                finally:
                    if in_caller:
                        for r in watch.ranks:
                            watch.exited(r)  # each once: a rank reported already is skipped

    def kill_now(self) -> None:
        """SIGKILL every rank's group and every descendant seen (no grace: the node is going)."""
        self.stopping.set()
        self.watch.may_sigkill_from(time.monotonic())
        for r in self.watch.ranks:
            with contextlib.suppress(OSError):
                os.killpg(r.proc.pid, signal.SIGKILL)
        for proc in self.watch.tracker.seen.values():
            try:
                proc.kill()
            except Exception:  # noqa: BLE001 - gone already
                pass

    def interrupt(self, ranks: list[int]) -> None:
        """SIGINT to these ranks of a session (a cell's interrupt), skipping any that has ended; the
        interrupt first on their command pipes, for a rank that has not started the cell yet."""
        watch = self.watch
        running = [
            r for r in watch.ranks if r.rank in ranks and r.rank not in watch.ended and r.dead_since is None
        ]
        if watch.session_pipes is not None:
            watch.session_pipes.mark_interrupt(r.rank for r in running)
        for r in running:
            send_signal(r, signal.SIGINT)
