"""What a surface asks a backend to run, and how the call ended: the backend seam's two data types.

A :class:`LaunchRequest` says *what* to run (the pickled payload, built once)
and *where* (the accelerator plan), with the call's timeout and extra
environment. It says nothing about how ranks are started (a backend's
business) nor about MLflow (a consumer's: the session passes the tracked
run's variables through ``env`` like any other).
"""

from __future__ import annotations

import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from air_magic.former_names import former_names
from air_magic.launch.accelerators import AcceleratorPlan
from air_magic.launch.settings import DEFAULT_STOP_GRACE
from air_magic.protocol.events import Outcome


@dataclass(frozen=True)
class LaunchRequest:
    """Everything a backend needs to run one call."""

    name: str  # the function's (or cell's) name, for display and logs
    payload: bytes  # cloudpickle of (fn, args, kwargs, cell sources)
    plan: AcceleratorPlan
    timeout: float | None
    env: dict[str, str] = field(default_factory=dict)  # extra variables for every rank
    stop_grace: float = DEFAULT_STOP_GRACE  # after a stop: seconds before SIGKILL (settings.stop_grace_s)
    # A script or ``-m`` module (air-magic run): exit status 0 is success, as under torchrun, even
    # without a result written (``os._exit(0)`` at its end). A function must return.
    exit_zero_succeeds: bool = False
    log_root: str | None = None  # where the call's log folder is made (None: paths.default_log_root)
    call_id: str | None = None  # the call's id, when the caller chose it (a detached run's); None: new
    # A persistent session's line to its ranks (calls/persistent.py); None for a one-off call.
    channel: CellChannel | None = None


class CellSender(Protocol):
    """How a persistent session reaches its ranks, whichever backend runs them (from any thread)."""

    def send_cell(self, number: int, payload: bytes) -> None: ...  # every rank runs cell ``number``

    def send_stop(self) -> None: ...  # every rank leaves its loop and ends like a call's rank

    def interrupt(self, ranks: list[int]) -> None: ...  # SIGINT to these ranks, if still running


class CellChannel(Protocol):
    """A persistent session's side of the line to its ranks (calls/persistent.py).

    The backend calls :meth:`connect` before any rank starts, with its :class:`CellSender`;
    each rank's answers come back as events (``protocol/events.CellAnswered``, after every
    byte that rank printed before it), to the session, a consumer of its call's events.
    """

    def connect(self, sender: CellSender) -> None: ...

    def own_outcome(
        self, outcome: Outcome, error: str | None, failed_rank: int | None
    ) -> tuple[Outcome, str | None, int | None]:
        """The session's outcome, from its ranks' (``outcome``, ``error``, the root cause's rank)
        and its cells': what its RunFinished says, so its history line and its tracked run agree."""
        ...

    def last_lines(self, rank: int, n: int) -> list[str]:
        """A rank's last lines since the session's current cell began (or its last one ended): what
        an error quotes, never an earlier cell's output."""
        ...


@former_names(run_id="call_id")
@dataclass
class RunResult:
    """How a call ended: every rank's value in rank order, or the error to raise.

    ``outcome`` is SUCCEEDED, FAILED, TIMEOUT or INTERRUPTED (stopped by
    :meth:`Backend.stop <air_magic.backends.base.Backend.stop>`).
    """

    call_id: str
    log_dir: str
    outcome: Outcome
    values: list[Any] | None = None
    error: BaseException | None = None

    @property
    def run_id(self) -> str:
        """The former name of call_id."""
        return self.call_id

    def unwrap(self) -> list[Any]:
        if self.error is not None:
            # Raised here, the traceback starts at the caller's line, not inside the backend.
            raise self.error
        assert self.values is not None
        return self.values


class StopRequest(threading.Event):
    """A backend's ``stop()`` flag, with the grace it asked for: the call's ``stop_grace`` unless a
    shorter one was asked (a process that is exiting cannot wait half a minute for its ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.grace_s: float | None = None
        self.signum = signal.SIGINT  # what the ranks get first: KeyboardInterrupt, as Ctrl-C gives

    def ask(self, grace_s: float | None = None, signum: int | None = None) -> None:
        if grace_s is not None:
            self.grace_s = grace_s if self.grace_s is None else min(self.grace_s, grace_s)
        if signum is not None:
            self.signum = signal.Signals(signum)
        self.set()

    def clear(self) -> None:
        super().clear()
        self.grace_s = None
        self.signum = signal.SIGINT

    def grace(self, stop_grace: float) -> float:
        """The grace the ranks get now: the call's, or a shorter one asked by ``stop()``."""
        return stop_grace if self.grace_s is None else min(stop_grace, self.grace_s)


def rank_succeeded(request: LaunchRequest, exit_code: int | None, returned: bool) -> bool:
    """The one rule for a rank that ended on its own: it exited 0 having written its result; a
    script's rank (``exit_zero_succeeds``) needs only the 0."""
    return exit_code == 0 and (returned or request.exit_zero_succeeds)


def new_call_id() -> str:
    """A call's id: timestamp first, so log folders sort by age."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
