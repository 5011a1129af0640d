"""A backend without processes: each rank plays a script, through the real call loop and ledger.

For tests, of air_magic and of code built on it, as httpx's ``MockTransport`` is
for HTTP clients: what the ranks do is written down, and everything after the
ranks (the call loop, ``backends/call_loop.py``; the ledger and its rules,
``outcome/ledger.py`` and ``outcome/failures.py``; the events, the displays, the
history, a persistent session's cells) is the code a real call runs::

    from air_magic.backends.scripted import Rank, ScriptedBackend

    backend = ScriptedBackend([
        Rank(prints=["step 1 loss 0.9"], returns=0.9),
        Rank(prints=["step 1 loss nan"], raises=FloatingPointError("loss is nan"), at=0.2),
    ])
    result = run_call("train", train, bound, settings, backend=backend)  # calls/call.py
    result.error  # FloatingPointError('loss is nan'), rank 1's, with its traceback as __cause__

A :class:`Rank` prints its lines (``prints`` on stdout, then ``stderr``), then
ends in one way: ``returns`` a value (the default: None), ``raises`` an
exception (its error record and traceback as a real rank writes them),
``killed_by`` a signal, ``exits`` with a status and no result, or ``hangs``
until the call stops it (``stop()``, the timeout, another rank's failure).
``at`` is when it ends, in seconds after the start, on the clock the root
cause is judged by; the ranks end in that order, at once (nothing waits for
``at``: only a rank that hangs waits). ``stuck_exiting``: it wrote its result or
error, but its process does not end (a thread that is not a daemon);
``seen_late``: its end reaches the caller only once the call is being stopped
(a busy machine, where a peer's error came first).

A persistent session (``request.channel``, ``calls/persistent.py``) gets a
:class:`~air_magic.launch.request.CellSender` before its ranks start; each rank
answers ready, then each cell as ``cells[number][rank]`` says (a ``Rank`` again:
its lines, then the cell's value, its exception, a death, or no answer until
the cell is interrupted, or none at all with ``deaf_to_sigint``, as a rank blocked in a
collective; a cell not in ``cells`` returns None on every rank);
when the session stops them, the ranks end as their own scripts say. A source
cell (``Session.run_cell``, a ``%%distributed`` cell: the payload calls
``worker/cell_runner.run_cell``) answers as a real rank's does, with a
:class:`~air_magic.worker.cell_runner.CellOutcome`: ``returns`` is the value of
the cell's last expression (none when its source does not end with one; a value
that cannot be pickled is its ``value_error``), rank 0 brings back no names, and
a ``CellOutcome`` given as ``returns`` is sent as it is; a source that does not
compile raises its ``SyntaxError`` on every rank that would return.

No process, socket, thread or file of its own: only the call's log folder the
loop makes, with each rank's log, as for any call. Unless ``log_dir=`` says
where (``request.log_root``), it is made under a temp folder of this process
(:func:`log_root`, removed at its exit), never under the default log root: a
scripted call is not in the run history (``air-magic runs``) and never prunes it.
Tracking is the settings' as for any call: ``tracking=False`` keeps a test's calls
out of the MLflow store in use.
Rank pids are above Linux's largest (``PID_MAX_LIMIT``): no process has one.
"""

from __future__ import annotations

import atexit
import dataclasses
import heapq
import inspect
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from air_magic.backends.call_loop import CallLoop
from air_magic.errors import ConfigurationError, LaunchError, PayloadError
from air_magic.launch.accelerators import AcceleratorPlan, default_cpu_ranks
from air_magic.launch.request import LaunchRequest, RunResult, StopRequest
from air_magic.launch.settings import LaunchSettings
from air_magic.protocol import serialization
from air_magic.protocol.events import EventBus
from air_magic.protocol.node_events import Answer, Exited, NodeEvent, Output, Raised, Returned
from air_magic.protocol.wire import ErrorRecord
from air_magic.worker import cell_runner

FIRST_PID = 1 << 22  # Linux's PID_MAX_LIMIT: a real pid is always below it
MEMORY = {"rss": 0}  # what a session's rank says it holds, in each answer


class _Unset:
    def __repr__(self) -> str:
        return "None"


_NONE: Any = _Unset()  # ``returns`` not given: the rank returns None, unless it ends another way


@dataclass(frozen=True)
class Rank:
    """What one rank does: prints its lines, then ends one way (see the module's text)."""

    prints: Sequence[str] = ()  # stdout lines (a str: its lines)
    stderr: Sequence[str] = ()  # stderr lines, after the stdout ones
    returns: Any = _NONE
    raises: BaseException | None = None
    killed_by: int | None = None  # a signal: SIGKILL, SIGSEGV, ... (no error record)
    exits: int | None = None  # an exit status, without a result (0: a script's os._exit(0))
    hangs: bool = False  # never ends on its own (in a cell: never answers until interrupted)
    # With hangs, in a cell: SIGINT does not end it either (a rank blocked in a collective's C code);
    # only the session's end stops it.
    deaf_to_sigint: bool = False
    at: float = 0.0  # seconds after the start (a cell's: after it was sent) when it ends
    stuck_exiting: bool = False  # returned or raised, but its process does not end
    seen_late: bool = False  # its exit is seen only once the call is being stopped

    def __post_init__(self) -> None:
        for name in ("prints", "stderr"):
            lines = getattr(self, name)
            if isinstance(lines, str):
                object.__setattr__(self, name, tuple(lines.splitlines()))
        endings = [
            self.returns is not _NONE,
            self.raises is not None,
            self.killed_by is not None,
            self.exits is not None,
            self.hangs,
        ]
        if sum(endings) > 1:
            raise ConfigurationError(f"{self}: one ending only (returns, raises, killed_by, exits or hangs)")
        if self.stuck_exiting and (self.killed_by is not None or self.exits is not None or self.hangs):
            raise ConfigurationError(f"{self}: stuck_exiting follows returns or raises")
        if self.deaf_to_sigint and not self.hangs:
            raise ConfigurationError(f"{self}: deaf_to_sigint is for a rank that hangs")
        if self.seen_late and (self.hangs or self.stuck_exiting):
            raise ConfigurationError(f"{self}: seen_late is for a rank that exits")
        if self.raises is not None and not isinstance(self.raises, BaseException):
            raise ConfigurationError(
                f"{self}: raises takes an exception (ValueError('...')), not {self.raises!r}"
            )
        if self.killed_by is not None and self.killed_by not in set(signal.Signals):
            raise ConfigurationError(
                f"{self}: killed_by takes a signal (signal.SIGKILL...), not {self.killed_by!r}"
            )
        if not self.at >= 0:
            raise ConfigurationError(f"{self}: at is seconds after the start (0 or more), not {self.at!r}")

    @property
    def value(self) -> Any:
        return None if self.returns is _NONE else self.returns


Script = Sequence[Rank] | Callable[[LaunchRequest], Sequence[Rank]]


class ScriptedBackend:
    """A :class:`~air_magic.backends.base.Backend` whose ranks play ``ranks``: one :class:`Rank`
    each, or a function of the call's request that gives them (a script per call, by its name).

    ``cells``: a session's scripts, ``{cell number: one Rank per rank}``; ``nodes``: ranks per
    node (default: one node). ``stops``: the (grace, signal) of each stop of the last call that
    found ranks still running.
    """

    name = "scripted"

    def __init__(
        self,
        ranks: Script,
        *,
        cells: Mapping[int, Sequence[Rank]] | None = None,
        nodes: Sequence[int] | None = None,
    ):
        self.ranks = ranks
        self.cells = dict(cells or {})
        for number, scripts in self.cells.items():  # refused here, not as the cell runs
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                raise ConfigurationError(f"cells: {number!r} is not a cell number (1, 2, ...)")
            if isinstance(scripts, Rank) or not all(isinstance(r, Rank) for r in scripts):
                raise ConfigurationError(f"cells[{number}] takes one Rank per rank (a list), not {scripts!r}")
            if not callable(ranks) and len(scripts) != len(ranks):
                raise ConfigurationError(
                    f"cells[{number}] has {len(scripts)} rank(s) scripted, the session {len(ranks)}"
                )
        self.nodes = list(nodes) if nodes is not None else None
        self.stops: list[tuple[float, int]] = []
        self._stop_requested = StopRequest()
        self._call: _ScriptedCall | None = None

    def prepare(self, settings: LaunchSettings) -> AcceleratorPlan:
        self._stop_requested.clear()  # as the local backend: a stop() between the two still counts
        world = settings.num_accelerators
        if not callable(self.ranks):
            if world is not None and world != len(self.ranks):
                raise ConfigurationError(
                    f"num_accelerators={world}, but the script has {len(self.ranks)} rank(s)"
                )
            world = len(self.ranks)
        return AcceleratorPlan(world_size=world or default_cpu_ranks(), gpus=(), detected="scripted ranks")

    def run(self, request: LaunchRequest, bus: EventBus) -> RunResult:
        scripts = list(self.ranks(request) if callable(self.ranks) else self.ranks)
        world = request.plan.world_size
        if len(scripts) != world or (self.nodes is not None and sum(self.nodes) != world):
            raise LaunchError(
                f"the script has {len(scripts)} rank(s) (nodes: {self.nodes}); the call has {world}"
            )
        self.stops = []
        if request.log_root is None:  # no log_dir= given: its logs are not the user's run history
            request = dataclasses.replace(request, log_root=log_root())
        call = _ScriptedCall(self, request, bus, scripts)
        self._call = call
        try:
            return call.execute()
        finally:
            self._call = None

    def stop(self, grace_s: float | None = None, signum: int | None = None) -> None:
        self._stop_requested.ask(grace_s, signum)
        call = self._call
        if call is not None:
            call.inbox.put(("wake",))

    def stacks(self) -> dict[int, str]:
        call = self._call
        return call.stacks() if call is not None else {}

    def running(self) -> list[int]:
        """The ranks of the call in progress that started and have not ended ([] between calls)."""
        call = self._call
        if call is None:
            return []
        return [r.rank for r in call.ledger.records if r.pid is not None and not r.exited]


class _ScriptedCall(CallLoop):
    """One call: the loop's hooks, with scripts for rank groups."""

    def __init__(self, backend: ScriptedBackend, request: LaunchRequest, bus: EventBus, scripts: list[Rank]):
        nodes = backend.nodes or [len(scripts)]
        names = [f"node {i}" for i in range(len(nodes))] if len(nodes) > 1 else None
        super().__init__(
            request, bus, stop_requested=backend._stop_requested, ranks_per_node=nodes, node_names=names
        )
        self.backend = backend
        self.scripts = scripts
        self.inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()  # a session's, and stop()'s
        self._due: list[tuple[float, int, int, list[NodeEvent]]] = []  # heap: (when, order, rank, facts)
        self._late: dict[int, Exited] = {}  # rank -> its exit, seen once the call is being stopped
        self._in_cell: dict[int, int] = {}  # a session's rank -> the cell it hangs in
        self._latest = 0.0  # the latest moment a fact was stamped with
        self._order = 0  # ties in time: in the order they were scheduled

    # -- the hooks ---------------------------------------------------------------------

    def start(self) -> bool:
        if self.request.channel is not None:  # a session: its line, before its ranks start
            self.request.channel.connect(_ScriptedCells(self.inbox))
        for rank in range(self.world):
            self.ledger.started(rank, FIRST_PID + rank)
        now = self._latest = time.monotonic()
        for rank, script in enumerate(self.scripts):
            if self.request.channel is not None:  # its lines, ready; its end when the session stops it
                self._schedule(rank, now, [*_lines(rank, script), _answer(rank, {"ready": True}, None)])
            else:
                self._schedule(rank, now + script.at, self._plays(rank, script, now + script.at))
        return True

    def pump(self, wait_s: float) -> None:
        if self._due:
            self._play_next()
            return
        try:
            message = self.inbox.get(timeout=max(0.0, wait_s))
        except queue.Empty:
            return
        self._command(message)

    def settle(self) -> None:
        while self._due:  # what the ranks did is on its way: it all comes before the stop
            self._play_next()

    def stop(self, grace_s: float, signum: int = signal.SIGTERM) -> None:
        self.ledger.begin_teardown()
        self.settle()
        running = [r for r in self.ledger.records if r.pid is not None and not r.exited]
        if not running:
            return
        self.backend.stops.append((grace_s, signum))
        now = self._now()
        for r in running:  # seen gone now: a late exit as it was, the others by our signal
            seen = self._late.pop(r.rank, None) or _exited(r.rank, -signum, now)
            seen = dataclasses.replace(seen, when=now + 0.001, teardown_at=now, sigkill_from=now + grace_s)
            self.ledger.take(r.node, seen)

    def stacks(self) -> dict[int, str]:
        where = f'  File "<scripted rank {{}}>", line 1 in {self.request.name}'
        return {
            rank: f"Thread 0x0000000000000001 (most recent call first):\n{where.format(rank)}"
            for rank in self.ledger.running()
        }

    # -- the scripts -------------------------------------------------------------------

    def _plays(self, rank: int, script: Rank, when: float) -> list[NodeEvent]:
        """A rank's facts as a call's rank: its lines, what it wrote, its exit (held back if seen late)."""
        facts = _lines(rank, script)
        if script.hangs:
            return facts
        record, result, text = self._outcome(rank, script, when)
        code: int | None = 1
        if record is not None:
            facts += [Raised(rank, record), Output(rank, "stderr", text.encode())]
        elif result is not None:
            facts.append(Returned(rank))
            code = 0
        else:
            code = -script.killed_by if script.killed_by is not None else script.exits
        if script.stuck_exiting:
            return facts
        exit_ = _exited(rank, code, when, result=result, error=record)
        if script.seen_late:
            self._late[rank] = exit_
        else:
            facts.append(exit_)
        return facts

    def _cell(self, number: int, source: _SourceCell | None) -> None:
        """Cell ``number`` on every rank still in the session (a rank stuck in a cell never reads it);
        ``source``: it runs a cell's source (``cell_runner.run_cell``), whose ranks answer CellOutcomes."""
        scripts = self.backend.cells.get(number) or [Rank()] * self.world
        if len(scripts) != self.world:
            raise LaunchError(f"cell {number}: {len(scripts)} rank(s) scripted, {self.world} in the session")
        now = self._now()
        for r in self.ledger.records:
            if r.exited or r.rank in self._in_cell:
                continue
            script = scripts[r.rank]
            when = now + script.at
            facts = _lines(r.rank, script)
            if script.hangs:  # no answer until the cell is interrupted
                self._in_cell[r.rank] = number
            elif script.killed_by is not None or script.exits is not None:  # the rank is gone
                code = -script.killed_by if script.killed_by is not None else script.exits
                facts.append(_exited(r.rank, code, when))
            else:
                record, result, text = self._outcome(r.rank, script, when, source)
                if record is not None:
                    facts.append(Output(r.rank, "stderr", text.encode()))
                facts.append(_answer(r.rank, {"cell": number, "ok": record is None}, record or result))
            self._schedule(r.rank, when, facts)

    def _outcome(
        self, rank: int, script: Rank, when: float, source: _SourceCell | None = None
    ) -> tuple[bytes | None, bytes | None, str]:
        """What a rank that raises or returns writes: (its error record, its pickled value, its traceback);
        in a source cell (``source``), what ``cell_runner.run_cell`` returns there."""
        if script.killed_by is not None or script.exits is not None:
            return None, None, ""
        exc, stage = script.raises, "run"
        if exc is None and source is not None:
            exc = source.error  # a source that does not compile fails on every rank that runs it
        if exc is None:
            try:
                value = script.value if source is None else source.outcome(script.value)
                return None, serialization.dumps_result(value), ""
            except Exception as error:  # noqa: BLE001 - reported as a real rank reports it
                exc = PayloadError(f"rank {rank}'s return value cannot be sent back: {error}")
                stage = "result"
        record, text = _error_record(rank, when, exc, stage, self.request.name)
        return record, None, text

    def _command(self, message: tuple[Any, ...]) -> None:
        """A session's message to its ranks (or a stop's wake-up: nothing to do)."""
        now = self._now()
        if message[0] == "cell":
            self._cell(message[1], message[2])
        elif message[0] == "interrupt":  # the ranks hanging in the cell raise KeyboardInterrupt
            for rank in message[1]:
                if self._deaf(rank):
                    continue
                number = self._in_cell.pop(rank, None)
                if number is not None and not self.ledger.records[rank].exited:
                    record, text = _error_record(rank, now, KeyboardInterrupt(), "run", self.request.name)
                    answer = _answer(rank, {"cell": number, "ok": False}, record)
                    self._schedule(rank, now, [Output(rank, "stderr", text.encode()), answer])
        elif message[0] == "stop":  # every rank leaves its loop and ends as its own script says
            for r in self.ledger.records:
                if not r.exited and r.rank not in self._in_cell:
                    script = dataclasses.replace(self.scripts[r.rank], prints=(), stderr=())  # said at start
                    self._schedule(r.rank, now + script.at, self._plays(r.rank, script, now + script.at))

    def _deaf(self, rank: int) -> bool:
        """The rank hangs in its cell and SIGINT does not reach it (``deaf_to_sigint``)."""
        number = self._in_cell.get(rank)
        scripts = self.backend.cells.get(number) if number is not None else None
        return scripts is not None and scripts[rank].deaf_to_sigint

    def _schedule(self, rank: int, when: float, facts: list[NodeEvent]) -> None:
        heapq.heappush(self._due, (when, self._order, rank, facts))
        self._order += 1

    def _play_next(self) -> None:
        when, _, rank, facts = heapq.heappop(self._due)
        self._latest = max(self._latest, when)
        node = self.ledger.records[rank].node
        for fact in facts:
            self.ledger.take(node, fact)

    def _now(self) -> float:
        """Now, never before a fact already played (``at`` runs ahead of the clock)."""
        return max(time.monotonic(), self._latest)


class _ScriptedCells:
    """A session's CellSender: each message goes to the call's loop, which plays the ranks' answers."""

    def __init__(self, inbox: queue.SimpleQueue[tuple[Any, ...]]):
        self._inbox = inbox

    def send_cell(self, number: int, payload: bytes) -> None:
        self._inbox.put(("cell", number, _SourceCell.of(payload)))

    def send_stop(self) -> None:
        self._inbox.put(("stop",))

    def interrupt(self, ranks: list[int]) -> None:
        self._inbox.put(("interrupt", list(ranks)))


def _lines(rank: int, script: Rank) -> list[NodeEvent]:
    return [
        Output(rank, stream, "".join(f"{line}\n" for line in lines).encode())
        for stream, lines in (("stdout", script.prints), ("stderr", script.stderr))
        if lines
    ]


def _exited(
    rank: int, code: int | None, when: float, result: bytes | None = None, error: bytes | None = None
) -> Exited:
    """The rank's process ended on its own (not while the call was being stopped)."""
    returned = result is not None
    return Exited(rank, code, when, result, returned, error, status_lost=False, teardown_at=None)


def _answer(rank: int, answer: dict[str, Any], outcome: bytes | None) -> Answer:
    return Answer(rank, {**answer, "memory": MEMORY}, outcome)


def _error_record(rank: int, when: float, exc: BaseException, stage: str, name: str) -> tuple[bytes, str]:
    """The record and traceback a real rank writes for ``exc`` (worker/entry.py's ``_report``)."""
    here = f'  File "<scripted rank {rank}>", line 1, in {name}\n'
    frames = traceback.format_tb(exc.__traceback__) or [here]
    text = "Traceback (most recent call last):\n" + "".join(frames)
    text += "".join(traceback.format_exception_only(type(exc), exc))
    record = ErrorRecord.of(exc, rank, when, stage, text)
    return serialization.dumps(record), text


@dataclass(frozen=True)
class _SourceCell:
    """A cell that runs source (its payload calls ``cell_runner.run_cell``), as its ranks see it."""

    ends_with_expression: bool  # its last statement is an expression: every rank sends back its value
    error: SyntaxError | None  # it does not compile: the error every rank raises

    @classmethod
    def of(cls, payload: bytes) -> _SourceCell | None:
        """The cell's source, if ``payload`` (a session cell's: ``((fn, args, kwargs, sources),
        caller)``, calls/cell_loop.py) runs one; None for a function (or one that does not load)."""
        try:
            fn, args, kwargs, _ = serialization.loads(serialization.loads(payload)[0])
            if fn is not cell_runner.run_cell:
                return None
            arguments = inspect.signature(cell_runner.run_cell).bind(*args, **kwargs).arguments
            source, filename = arguments["source"], arguments["filename"]
        except Exception:  # noqa: BLE001 - not a source cell this backend can read: a function's
            return None
        try:
            _, last = cell_runner.compile_cell(source, filename)  # as the rank's run_cell does first
        except SyntaxError as exc:
            return cls(False, exc)
        return cls(last is not None, None)

    def outcome(self, value: Any) -> cell_runner.CellOutcome:
        """What a rank's ``run_cell`` returns when the cell's last expression is ``value``."""
        if isinstance(value, cell_runner.CellOutcome):
            return value
        outcome = cell_runner.CellOutcome(value=None)
        if self.ends_with_expression:
            try:
                outcome.value = serialization.dumps_result(value)
            except Exception as exc:  # noqa: BLE001 - as cell_runner.run_cell: said, not raised
                outcome.value_error = f"{serialization.describe_type(value)}: {exc}"
        return outcome


_log_root: str | None = None  # this process's folder for scripted calls' log folders (log_root())
_log_root_lock = threading.Lock()


def log_root() -> str:
    """Where a scripted call without ``log_dir=`` makes its log folder: a private temp folder of
    this process (``tempfile.mkdtemp``), made at its first call and removed at its exit."""
    global _log_root
    with _log_root_lock:
        if _log_root is None or not os.path.isdir(_log_root):
            _log_root = tempfile.mkdtemp(prefix="air-magic-scripted-")
            atexit.register(_remove_log_root, _log_root, os.getpid())
        return _log_root


def _remove_log_root(path: str, pid: int) -> None:
    if os.getpid() == pid:  # not a forked child's exit: the folder is its parent's
        shutil.rmtree(path, ignore_errors=True)
