"""Steps 1 and 2 of a rank group (``rank_group.py``): the call folder's files, then the ranks.

:func:`write_call_files` writes ``launch.json`` (the caller's sys.path and argv)
and the payload (``protocol/wire.py``) into the group's call folder.
:class:`RankStart` then starts the ranks: forks of the warm starter when one is
ready (``warm.py``; waited for no longer than the spec says, a stop seen while
it imports), else fresh interpreters (``ranks.spawn_rank``), each with
torchrun's variables for its place (``GroupSpec.rank_environments``), its stdout
and stderr on pipes the watch reads (``rank_watch.py``) and a lifeline whose end
kills it when this process dies. Each rank starts under the stop's lock
(``rank_stop.py``): a stop sees it, or comes before it and no more start.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable

from air_magic.node import warm
from air_magic.node.group_spec import GroupSpec
from air_magic.node.rank_stop import RankStop
from air_magic.node.rank_watch import TICK_S, RankWatch
from air_magic.node.ranks import spawn_rank
from air_magic.protocol import wire


def write_call_files(spec: GroupSpec, call_dir: str, payload: bytes) -> None:
    """``launch.json`` and the payload, in the call folder, for the ranks to read as they start."""
    # The caller's sys.path, as it is. On a Ray node: where it exists there (the same paths on
    # every node is the simple way), then the agent's own (runtime_env's working_dir, py_modules).
    sys_path = list(spec.sys_path)
    if spec.by_agent:
        caller = [p for p in sys_path if p == "" or os.path.isdir(p) or os.path.isfile(p)]
        sys_path = caller + [p for p in sys.path if p not in caller]
    launch = {"sys_path": sys_path, "argv": list(spec.argv) or [""]}
    wire.write_atomically(os.path.join(call_dir, wire.LAUNCH_FILE), json.dumps(launch).encode())
    wire.write_atomically(os.path.join(call_dir, wire.PAYLOAD_FILE), payload)


class RankStart:
    """Starts one group's ranks; holds what they need while they run (the lifeline, the starter)."""

    def __init__(self, spec: GroupSpec, call_dir: str, watch: RankWatch, rank_stop: RankStop):
        self.spec = spec
        self.call_dir = call_dir
        self.watch = watch
        self.rank_stop = rank_stop
        self._lifeline_w: int | None = None
        self._held_starter: warm.Starter | None = None

    def start(
        self, give_up: Callable[[], bool], before_ranks: Callable[[warm.Starter | None], None] | None
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
            self.rank_stop.stop(0)
            raise
        finally:
            os.close(lifeline_r)

    def _start_with(
        self,
        lifeline_r: int,
        give_up: Callable[[], bool],
        before_ranks: Callable[[warm.Starter | None], None] | None,
    ) -> list[tuple[int, int]] | None:
        spec, stopping = self.spec, self.rank_stop.stopping
        cwd = spec.cwd if os.path.isdir(spec.cwd) else os.getcwd()
        # As the ranks will start (exec keeps SIG_IGN): a stop then asks them with SIGTERM.
        self.rank_stop.ranks_ignore_sigint = warm.sigint_ignored()
        envs = spec.rank_environments(self.call_dir, lifeline_r, self.watch.metrics_dir)
        starter = None
        if spec.warm_start and envs:
            starter = self._ready_starter(envs[0], give_up)
            if starter is None and (give_up() or stopping.is_set()):
                return None
        if starter is not None:
            # Held: not closed by a rebuild or %distributed restart while its forks run this call;
            # released when every rank is reaped. Its exit reports wake the selector as they come.
            self._held_starter = starter
            self.watch.watch_starter(starter)
        if before_ranks is not None:
            before_ranks(starter)
        started: list[tuple[int, int]] = []
        for rank, env in zip(spec.ranks, envs, strict=True):
            with self.rank_stop.lock:  # a stop either sees this rank, or comes before it is started
                if stopping.is_set():
                    break  # stopped while starting: no more ranks
                spawn = functools.partial(spawn_rank, starter, rank, env, cwd, self.call_dir, lifeline_r)
                try:
                    slot = self.watch.start_rank(rank, spawn)
                except OSError as exc:
                    raise OSError(f"could not start rank {rank} with {sys.executable}: {exc}") from exc
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
            if self.rank_stop.stopping.is_set() or give_up() or time.monotonic() >= end:
                return None

    def close(self) -> None:
        """After the end: the lifeline (ranks die with it if anything before failed), then the
        starter held for this call."""
        if self._lifeline_w is not None:
            os.close(self._lifeline_w)
            self._lifeline_w = None
        if self._held_starter is not None:
            warm.release(self._held_starter)
            self._held_starter = None
