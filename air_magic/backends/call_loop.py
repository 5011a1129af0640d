"""The one call loop: start a call's ranks, follow them, stop them, build the outcome.

Every backend runs its calls through :meth:`CallLoop.execute` (the template,
as torch.distributed.elastic's ``_invoke_run``), and supplies the hooks that
differ: how its rank groups start (:meth:`CallLoop.start`), how their facts
reach the caller (:meth:`CallLoop.pump`: in-process on this machine, long
polls on a Ray cluster), how they are stopped, where stacks come from. The
facts go to one :class:`~air_magic.outcome.ledger.CallLedger`, which decides how
each rank ended and what the call's outcome is::

    RunStarted, as the log folder is made (so `air-magic runs` sees the call from its first moment)
    start()                        -> RankStarted (ledger.started)
    until the first failure, the timeout, a stop or every rank's exit:
        pump(wait)                 -> output, error records, exits ... (ledger.take)
    failure   -> settle(); fail(): stop(3 s); ledger.failure_error()   (the root cause)
    timeout   -> stacks(); stop(3 s); ledger.timeout_error()
    stop()    -> stop(the call's stop grace, SIGINT); stopped_error()
    succeeded -> ledger.results(), in rank order
    stop(3 s) (nothing left: a no-op), finish(), RunFinished
"""

from __future__ import annotations

import signal
import time
from abc import ABC, abstractmethod

from air_magic.backends.output import OutputRouter, make_log_dir
from air_magic.errors import DistributedTimeoutError, PayloadError
from air_magic.launch.request import LaunchRequest, RunResult, StopRequest, new_call_id
from air_magic.node.open_files import ensure_open_files
from air_magic.outcome.ledger import CallLedger, stopped_error
from air_magic.outcome.stacks import discard_rank_files
from air_magic.protocol.events import EventBus, Outcome, RunFinished, RunStarted, Tick

# How long ranks get between SIGTERM and SIGKILL after a failure or a timeout: long enough for
# Python to run its atexit hooks and flush logs, short enough that a stuck rank does not hold the
# GPUs for long. (A stop from the user has the call's stop_grace.)
GRACE_S = 3.0
TICK_S = 0.2  # how often the loop wakes without news, for displays and the deadline


class CallLoop(ABC):
    """One call, from its ranks' start to the last exit; a backend fills in the hooks."""

    def __init__(
        self,
        request: LaunchRequest,
        bus: EventBus,
        *,
        stop_requested: StopRequest,
        ranks_per_node: list[int],
        node_names: list[str] | None = None,
        clocks: list[float] | None = None,
        caller_clock: float = 0.0,
    ):
        self.request = request
        self.bus = bus
        self.call_id = call_id = request.call_id or new_call_id()
        self.log_dir = log_dir = make_log_dir(request.log_root, call_id)
        self.stop_requested = stop_requested
        self.world = request.plan.world_size
        ensure_open_files(self.world)  # the logs below, and each rank's pipes and pidfd
        self.router = OutputRouter(log_dir, self.world, bus)
        self.ledger = CallLedger(
            request,
            bus,
            self.router,
            log_dir,
            ranks_per_node=ranks_per_node,
            node_names=node_names or ["this machine"],
            clocks=clocks or [0.0] * len(ranks_per_node),
            caller_clock=caller_clock,
        )
        self.started = time.monotonic()
        self.deadline = None if request.timeout is None else self.started + request.timeout
        # Last, once nothing here can fail (execute() then always says RunFinished): the folder's
        # run.json says what runs from its first moment (`air-magic runs`).
        bus.emit(
            RunStarted(
                call_id=call_id,
                world_size=self.world,
                backend=request.plan.backend,
                detected=request.plan.detected,
                cpu_mode=request.plan.cpu_mode,
                log_dir=log_dir,
                name=request.name,
                ranks_per_node=tuple(ranks_per_node),
            )
        )

    # -- the hooks ---------------------------------------------------------------------

    @abstractmethod
    def start(self) -> bool:
        """Start every rank (``ledger.started`` for each); False if the timeout or a stop came first."""

    @abstractmethod
    def pump(self, wait_s: float) -> None:
        """Hand the ledger what the rank groups report within ``wait_s``."""

    @abstractmethod
    def stop(self, grace_s: float, signum: int = signal.SIGTERM) -> None:
        """Stop every rank (``signum``, ``grace_s``, SIGKILL); return with every exit in the ledger.
        A second KeyboardInterrupt meanwhile kills at once and is raised."""

    @abstractmethod
    def stacks(self) -> dict[int, str]:
        """Every running rank's thread stacks, by rank (from any thread)."""

    def settle(self) -> None:  # noqa: B027 - optional: most backends have nothing on its way
        """After the first failure, before the others are stopped: news already on its way."""

    def finish(self) -> None:  # noqa: B027 - optional: a backend may hold nothing
        """Every rank is gone: the rest of their output, the groups' folders and stores."""

    def start_timeout_error(self) -> BaseException:
        """The timeout ran out before any rank started (a warm starter was still importing)."""
        timeout = self.request.timeout or 0.0
        return DistributedTimeoutError(
            f"timed out after {timeout:g} s (timeout={timeout:g}) before any rank started. No rank ran.",
            still_running=[],
            log_dir=self.log_dir,
        )

    def fail(self) -> BaseException:
        """A rank failed: stop the others, then the root cause's error."""
        self.stop(GRACE_S)
        return self.ledger.failure_error()

    # -- the template ------------------------------------------------------------------

    def execute(self) -> RunResult:
        """Run the call to its end (its RunStarted was said as its log folder was made)."""
        outcome = Outcome.FAILED
        error: BaseException | None = None
        try:
            if self.stop_requested.is_set():  # stopped before a rank started: nothing is started
                outcome, error = Outcome.INTERRUPTED, stopped_error(self.request.name)
                return self._result(outcome, error=error)
            if not self.start():
                if self.stop_requested.is_set():
                    outcome, error = Outcome.INTERRUPTED, stopped_error(self.request.name)
                else:
                    outcome, error = Outcome.TIMEOUT, self.start_timeout_error()
                return self._result(outcome, error=error)
            outcome = self._watch()
            if outcome is Outcome.SUCCEEDED:
                try:
                    return self._result(outcome, values=self.ledger.results())
                except PayloadError as exc:
                    outcome, error = Outcome.FAILED, exc
            elif outcome is Outcome.INTERRUPTED:  # stop() from another thread
                self.stop(self.stop_requested.grace(self.request.stop_grace), self.stop_requested.signum)
                error = stopped_error(self.request.name)
            elif outcome is Outcome.TIMEOUT:
                running = self.ledger.running()
                stacks = self.stacks()  # before they are stopped: what each rank was doing
                self.stop(GRACE_S)
                error = self.ledger.timeout_error(running, stacks)
            else:
                error = self.fail()
            return self._result(outcome, error=error)
        except KeyboardInterrupt as exc:
            outcome = Outcome.INTERRUPTED
            signum = getattr(exc, "signum", signal.SIGINT)
            self.stop(self.stop_requested.grace(self.request.stop_grace), signum)
            raise
        except BaseException as exc:  # a rank that could not start, an agent lost while starting...
            error = exc
            raise
        finally:
            try:
                try:
                    self.stop(GRACE_S)  # a no-op when every rank is already accounted for
                finally:
                    self.finish()  # (a second Ctrl-C may land in either: what follows still runs)
            finally:
                self.router.close()
                discard_rank_files(self.log_dir)  # the ranks are gone: their stack files with them
                said = None if error is None else f"{type(error).__name__}: {error}"
                failed_rank = self.ledger.failed_rank
                if self.request.channel is not None:  # a session: its cells' outcomes count too
                    outcome, said, failed_rank = self.request.channel.own_outcome(outcome, said, failed_rank)
                self.bus.emit(
                    RunFinished(
                        call_id=self.call_id,
                        outcome=outcome,
                        elapsed=time.monotonic() - self.started,
                        log_dir=self.log_dir,
                        error=said,
                        failed_rank=failed_rank,
                    )
                )

    def _result(self, outcome: Outcome, **kwargs: object) -> RunResult:
        return RunResult(self.call_id, self.log_dir, outcome, **kwargs)  # type: ignore[arg-type]

    def _watch(self) -> Outcome:
        """Follow the ranks; SUCCEEDED, FAILED, TIMEOUT or INTERRUPTED (stop())."""
        next_tick = 0.0
        while True:
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + TICK_S
                self.bus.emit(Tick(elapsed=now - self.started))
            if self.stop_requested.is_set():
                return Outcome.INTERRUPTED
            if self.ledger.failed(now):
                self.settle()
                return Outcome.FAILED
            if self.ledger.all_exited():
                return Outcome.SUCCEEDED
            wait = TICK_S
            if self.deadline is not None:
                wait = min(wait, self.deadline - now)
                if wait <= 0:
                    return Outcome.TIMEOUT
            self.pump(wait)

    def _deadline_passed(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline
