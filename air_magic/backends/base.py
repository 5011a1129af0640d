"""The backend seam: what every backend (local processes today, a Ray cluster later) implements.

The call layer (``calls/call.py``) picks a backend for a call and drives it
in three steps:

1. :meth:`Backend.prepare` — get ready for a call with these settings (start
   what is slow to start, find the accelerators) and say what the call will run
   on. Nothing the user can see has started yet; a mistake raises here.
2. :meth:`Backend.run` — run the request on every rank; report what happens as
   events on the bus (``protocol/events.py``: RunStarted, RankStarted,
   RankOutput, RankExited, Tick, RunFinished, in that order for each rank), and
   return a :class:`~air_magic.launch.request.RunResult`. It returns only when
   every rank, and everything a rank started, is gone. A ``KeyboardInterrupt``
   on the calling thread stops every rank and is raised again.
3. :meth:`Backend.stop` — from any thread: stop the call in progress as an
   interrupt would (every rank and its children, a short grace); ``run`` then
   returns an 'interrupted' result. Harmless when nothing runs.
4. :meth:`Backend.stacks` — from any thread: every running rank's thread stacks
   (``outcome/stacks.py``), by rank; ``{}`` when nothing runs.

A new backend is done when ``tests/contract/test_backend_contract.py`` passes for it.
"""

from __future__ import annotations

from typing import Protocol

from air_magic.launch.accelerators import AcceleratorPlan
from air_magic.launch.request import LaunchRequest, RunResult
from air_magic.launch.settings import LaunchSettings
from air_magic.protocol.events import EventBus


class Backend(Protocol):
    name: str  # how logs and the contract suite call it: 'local-fresh', 'local-warm', ...

    def prepare(self, settings: LaunchSettings) -> AcceleratorPlan: ...

    def run(self, request: LaunchRequest, bus: EventBus) -> RunResult: ...

    # grace_s: shorter than the call's stop_grace; signum: instead of SIGINT (SIGTERM at exit)
    def stop(self, grace_s: float | None = None, signum: int | None = None) -> None: ...

    def stacks(self) -> dict[int, str]: ...
