"""Detached runs: ranks under a supervisor process that outlives the kernel; attach from any kernel.

``detach=True`` (``--detach``) sends a prepared call (``calls/call.prepare_call``)
to a supervisor (``calls/supervisor.py``) instead of running it in this
process. Everything lives in one private folder per run,
``~/.local/state/air_magic/detached/<id>/`` (0700, this user's alone; the root
is checked like the log root)::

    request.pkl    kernel -> supervisor: the call (deleted once read: the arguments in clear)
    state.json     what the run is and how it stands (rewritten at each change)
    events.jsonl   every event of the call, in parts (protocol/event_log.py): an attach replays the newest
    result.pkl     every rank's value, or the error
    supervisor.log the supervisor's own output

:func:`start_detached` writes the request, starts the supervisor in a session of
its own and follows the run like :func:`attach` does: a :class:`RunHandle` whose
displays replay ``events.jsonl``. ``runs()`` lists every detached run of this
user on this machine; ``attach(run)`` re-opens one: what was printed so far,
then the stream, and the handle (result, cancel, stacks). Cancel is SIGTERM to
the supervisor, which stops the ranks as an interrupt would. A kernel that goes
away stops following; the run goes on. Nothing travels over a socket.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import psutil

from air_magic import paths, private_files
from air_magic.calls.background import RunHandle, read_rank_log, show_displays
from air_magic.display.widgets import make_consumers
from air_magic.errors import ConfigurationError, LaunchError
from air_magic.launch.accelerators import AcceleratorPlan
from air_magic.launch.request import RunResult
from air_magic.launch.settings import stop_grace_s
from air_magic.outcome.stacks import take_stacks
from air_magic.protocol import event_log, serialization, wire
from air_magic.protocol.events import (
    Event,
    Outcome,
    RankExited,
    RankStarted,
    RecordLink,
    RunFinished,
    RunStarted,
    Tick,
)
from air_magic.threads import start_in_context

REQUEST = paths.DETACHED_REQUEST
STATE = paths.DETACHED_STATE
EVENTS = paths.DETACHED_EVENTS
RESULT = paths.DETACHED_RESULT
SUPERVISOR_LOG = paths.SUPERVISOR_LOG
KEEP_ENDED = 50  # ended runs' folders kept (their events can be large; the logs stay in the log root)
RESULT_WAIT_S = 60.0  # after the last event: the supervisor writes the result, then ends the MLflow run
TICK_S = 0.2
# A full disk under the run's folder at the call's end: how long the supervisor waits for room to
# write the end (the events, state.json, the result) before it gives up (the run is then "lost").
ROOM_WAIT_S = 600.0
_ROOM_BYTES = 1 << 20  # less free than this under a run whose ranks are gone: it waits for room
REPLAY_WAIT_S = 30.0  # attach() returns once the events so far are replayed, or after this long
_LIVE = ("starting", Outcome.RUNNING)
_ROOT_FIX = "Set XDG_STATE_HOME to a folder only you can write"


@dataclass(frozen=True)
class DetachedRequest:
    """What the supervisor needs to run the call: the prepared call, without its backend."""

    name: str
    kind: str
    settings_raw: dict[str, Any]
    plan: AcceleratorPlan
    payload: bytes
    facts: Any  # tracking.CallFacts, or None when the call is not tracked
    sys_path: list[str]
    argv: list[str]
    active: Any = None  # the caller's active MLflow run, under which the call's run nests
    state: dict[str, Any] = dataclasses.field(default_factory=dict)  # a Ray job's first state.json


@dataclass(frozen=True)
class DetachedRun:
    """One detached run, as ``runs()`` lists it."""

    id: str
    name: str
    status: str  # starting, running, succeeded, failed, timeout, cancelled, or lost (its supervisor died)
    world_size: int
    started: float  # wall clock
    log_dir: str | None
    folder: str
    pid: int | None
    mlflow: str | None
    cluster: str | None = None  # a Ray job's: the cluster's dashboard address (calls/ray_jobs.py)

    def __str__(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        ranks = f"{self.world_size} rank(s)"
        return f"{self.id}  {self.status:<9}  {ranks}  {when}  {self.name}  logs: {self.log_dir}"


def root() -> str:
    return private_files.private_root(
        paths.state_dir(paths.DETACHED_DIR), "the detached runs' folder", _ROOT_FIX
    )


# -- starting ---------------------------------------------------------------------------


def start_detached(prepared: Any, on_result: Any = None, consumers: Sequence[Any] = ()) -> RunHandle:
    """Hand ``prepared`` to a new supervisor; follow it here. Returns at once."""
    from air_magic.launch.request import new_call_id

    call_id = new_call_id()
    folder = os.path.join(paths.state_dir(paths.DETACHED_DIR), call_id)  # named in an error
    try:
        folder = os.path.join(root(), call_id)
        os.mkdir(folder, 0o700)
        _prune()
        request = request_for(prepared)
        wire.write_atomically(os.path.join(folder, REQUEST), serialization.dumps(request))
        # Written once here, before the supervisor exists; from then on the supervisor alone writes it.
        write_state(folder, first_state(call_id, prepared))
        private_files.create_private_file(os.path.join(folder, EVENTS))  # a follower opens it at once
        log = private_files.open_private(
            os.path.join(folder, SUPERVISOR_LOG), os.O_WRONLY | os.O_APPEND | os.O_CREAT
        )
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "air_magic.calls.supervisor", folder],
                env=supervisor_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # a kernel's death, a closed terminal, a SIGHUP: none reach it
            )
        finally:
            os.close(log)
    except BaseException as exc:
        shutil.rmtree(folder, ignore_errors=True)  # no supervisor: nothing of it may stay (the arguments)
        if isinstance(exc, OSError):
            raise _not_started(call_id, folder, exc) from exc
        raise
    # The supervisor's state.json now says which GPUs it holds, for every process: this one's claim goes.
    prepared.abandon()
    _reap_later(proc)
    return follow_run(FolderRun(folder), make_consumers(prepared.settings.display), on_result, consumers)


def _not_started(call_id: str, folder: str, exc: OSError) -> LaunchError:
    """The one-line error of a detached run that could not be handed to a supervisor."""
    why = exc.strerror or str(exc)
    room = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    fix = (
        "free some space on that disk, or set XDG_STATE_HOME to a folder on another"
        if room
        else "nothing was started"
    )
    return LaunchError(f"detached run {call_id} could not be started in {folder}: {why}; {fix}")


def request_for(prepared: Any) -> DetachedRequest:
    """What a supervisor (here, or a Ray job's) needs of ``prepared`` to run it."""
    return DetachedRequest(
        name=prepared.name,
        kind=prepared.kind,
        settings_raw=dict(prepared.settings.raw),
        plan=prepared.plan,
        payload=prepared.payload,
        facts=_facts_for_elsewhere(prepared.facts),
        sys_path=list(sys.path),
        argv=list(sys.argv) or [""],
        active=prepared.run_owner.remembered_active if prepared.run_owner is not None else None,
    )


def first_state(call_id: str, prepared: Any) -> dict[str, Any]:
    """A run's state.json before its supervisor runs."""
    return {
        "id": call_id,
        "name": prepared.name,
        "status": "starting",
        "started": time.time(),
        "world_size": prepared.plan.world_size,
        "kind": prepared.kind,
        "gpus": [g.uuid for g in prepared.plan.gpus],
        "stop_grace": stop_grace_s(prepared.settings.stop_grace),  # what cancel() waits out
    }


def _facts_for_elsewhere(facts: Any) -> Any:
    """The call's facts with its experiment named: the supervisor is not the notebook or script
    whose name the default experiment takes (MLflow's own variables travel in the environment)."""
    if facts is None or facts.experiment is not None:
        return facts
    if os.environ.get("MLFLOW_EXPERIMENT_ID") or os.environ.get("MLFLOW_EXPERIMENT_NAME"):
        return facts
    from air_magic.tracking import store

    if store.active_experiment_id() is not None:  # mlflow.set_experiment(): _supervisor_env passes it
        return facts
    return dataclasses.replace(facts, experiment=store.default_experiment_name())


def supervisor_env() -> dict[str, str]:
    """This process's environment, with the MLflow store and experiment it would use said
    explicitly (mlflow.set_tracking_uri() and set_experiment() live in this process only), and
    whether a kernel's call would start the store's MLflow UI (tracking/ui.py)."""
    env = dict(os.environ)
    from air_magic.tracking import store
    from air_magic.tracking import ui as mlflow_ui

    if mlflow_ui.auto_start_allowed():  # started from a notebook: its run link opens, as a call's does
        env[mlflow_ui.AUTO_ENV] = "1"

    chosen = store.active_experiment_id()  # mlflow.set_experiment() in this process
    if chosen is not None and "MLFLOW_EXPERIMENT_ID" not in env:
        env["MLFLOW_EXPERIMENT_ID"] = chosen
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and "MLFLOW_TRACKING_URI" not in env:
        try:
            from mlflow.tracking._tracking_service import utils as tracking_utils

            if tracking_utils._tracking_uri is not None:  # set in code, not by the environment
                env["MLFLOW_TRACKING_URI"] = str(tracking_utils._tracking_uri)
        except Exception:  # noqa: BLE001 - MLflow's private detail moved: the default store then
            pass
    return env


def _reap_later(proc: subprocess.Popen[bytes]) -> None:
    """Wait for the supervisor in a daemon thread, so a kernel that stays up keeps no zombie."""
    threading.Thread(target=proc.wait, name="air_magic-supervisor-reaper", daemon=True).start()


# -- listing and attaching ----------------------------------------------------------------


def runs() -> list[DetachedRun]:
    """Every detached run of this user on this machine, newest first."""
    found = []
    base = root()
    try:
        entries = sorted(os.scandir(base), key=lambda e: e.name, reverse=True)
    except OSError as exc:  # unreadable: one line for the user, not a traceback
        raise ConfigurationError(
            f"cannot read the detached runs' folder {base}: {exc.strerror or exc}. {_ROOT_FIX}"
        ) from None
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            info = _read_run(entry.path)
            if info is not None:
                found.append(info)
    return found


def attach(
    run: str | DetachedRun | None = None, display: str = "auto", consumers: Sequence[Any] = ()
) -> RunHandle:
    """Re-open a detached run (default: the newest one still running): its output so far, then the
    stream, in this cell; the handle's result() waits for the end, cancel() stops it."""
    info = _find(run)
    state = _state_of(info.folder)
    # A cell's ranks return their cell's outcome; another kernel gets each rank's last value (the
    # names go back only to the kernel that ran the cell, when its handle's result() is called).
    on_result = cell_values if state.get("kind") == "cell" else None
    return follow_run(FolderRun(info.folder), make_consumers(display), on_result, consumers)


def cell_values(result: RunResult) -> list[Any]:
    return [serialization.loads(o.value) if o.value is not None else None for o in result.unwrap()]


def find(run: str | DetachedRun | None) -> DetachedRun:
    """The detached run ``run`` names (its id or the start of it; None: the newest running)."""
    return _find(run)


def _find(run: str | DetachedRun | None) -> DetachedRun:
    if isinstance(run, DetachedRun):
        return run
    listed = runs()
    if run is None:
        live = [r for r in listed if r.status in _LIVE]
        if not live:
            raise ConfigurationError("no detached run is running (air_magic.runs() lists them all)")
        return live[0]
    matches = [r for r in listed if r.id == run] or [r for r in listed if r.id.startswith(str(run))]
    if len(matches) != 1:
        known = ", ".join(r.id for r in listed[:5]) or "none"
        what = "no" if not matches else "more than one"
        raise ConfigurationError(f"{what} detached run matches {run!r} (the newest: {known})")
    return matches[0]


def _read_run(folder: str) -> DetachedRun | None:
    state = _read_state(folder)
    if state is None:
        state = _recovered_state(folder)
        if state is None:
            return None
    status = state.get("status", "starting")
    supervisor = _supervisor(folder)
    if status in _LIVE and not _supervisor_alive(folder, state):
        status = "lost"
    return DetachedRun(
        id=state.get("id", os.path.basename(folder)),
        name=state.get("name", "?"),
        status=status,
        world_size=int(state.get("world_size", 0)),
        started=float(state.get("started", 0.0)),
        log_dir=state.get("log_dir"),
        folder=folder,
        pid=supervisor[0] if supervisor else None,
        mlflow=state.get("mlflow"),
    )


START_GRACE_S = 30.0  # a supervisor that has not said it listens after this long did not start


def _supervisor(folder: str) -> tuple[int, float] | None:
    """(pid, start time) the supervisor wrote as its first act (its ``listening`` mark)."""
    try:
        with open(os.path.join(folder, paths.DETACHED_LISTENING)) as f:
            pid, started = f.read().split()
        return int(pid), float(started)
    except (OSError, ValueError):
        return None


def _supervisor_alive(folder: str, state: dict[str, Any] | None = None) -> bool:
    supervisor = _supervisor(folder)
    if supervisor is None:  # still starting (or it died doing so): a young run counts as alive
        state = state if state is not None else (_read_state(folder) or {})
        return time.time() - float(state.get("started", 0.0)) < START_GRACE_S
    pid, started = supervisor
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - started) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class RunPlace(Protocol):
    """Where a detached run is kept, as a follower reads it: a folder on this machine
    (:class:`FolderRun`), or a Ray job's folder on its cluster (``calls/ray_jobs.JobRun``). The
    supervisor writes the same things to both: state, events in parts, the result."""

    id: str

    def state(self) -> dict[str, Any]: ...
    def replay_from(self) -> int: ...  # the event log's part a new follower starts at
    # A part's lines as written; None: nothing new now. The lines end when the writer is gone and
    # everything it wrote was given (a place that cannot tell says so with None and alive()).
    def lines_of(self, part: int, stop: threading.Event) -> event_log.Lines: ...
    def alive(self) -> bool: ...  # its supervisor lives (or is still starting)
    def result(self) -> RunResult | None: ...  # once written (waits while the supervisor lives)
    def lost(self) -> str: ...  # why there is no result
    def cancel(self) -> None: ...
    def why_not_ended(self) -> str | None: ...  # its ranks are gone, yet it has not ended: why
    def stacks(self, pids: dict[int, int], log_dir: str | None) -> dict[int, str]: ...
    def rank_log(self, rank: int, log_dir: str | None) -> str: ...  # '' while there is none


class FolderRun:
    """A detached run of this machine: its folder under :func:`root`."""

    def __init__(self, folder: str) -> None:
        _check_ours(folder)
        self.folder = folder
        self.id = _state_of(folder).get("id", os.path.basename(folder))

    def state(self) -> dict[str, Any]:
        return _state_of(self.folder)

    def replay_from(self) -> int:
        return event_log.replay_from(os.listdir(self.folder))

    def lines_of(self, part: int, stop: threading.Event) -> event_log.Lines:
        return event_log.file_lines(os.path.join(self.folder, event_log.part_name(part)), stop)

    def alive(self) -> bool:
        return _supervisor_alive(self.folder)

    def result(self) -> RunResult | None:
        path = os.path.join(self.folder, RESULT)
        while not os.path.exists(path) and _supervisor_alive(self.folder):
            time.sleep(0.05)
        data = wire.read_bytes(path)
        if data is None:
            return None
        result: RunResult = serialization.loads(data)  # this user's own folder: its supervisor wrote it
        return result

    def lost(self) -> str:
        return lost_text(self.folder, self.id)

    def cancel(self) -> None:
        _signal_supervisor(self.folder)

    def why_not_ended(self) -> str | None:
        return _waiting_for_room(self.folder)

    def stacks(self, pids: dict[int, int], log_dir: str | None) -> dict[int, str]:
        return take_stacks(pids, log_dir) if log_dir else {}

    def rank_log(self, rank: int, log_dir: str | None) -> str:
        return read_rank_log(log_dir, rank)


def _waiting_for_room(folder: str) -> str | None:
    """Why a run whose ranks are all gone has not ended: its supervisor waits for room on a full
    disk to write the run's end (calls/supervisor.py, ``ROOM_WAIT_S``). None where a rank (a child
    of the supervisor) still runs, the supervisor is gone, or the disk has room."""
    supervisor = _supervisor(folder)
    if supervisor is None or not _supervisor_alive(folder):
        return None
    try:
        children = psutil.Process(supervisor[0]).children(recursive=True)
        if any(child.status() != psutil.STATUS_ZOMBIE for child in children):
            return None
        free = shutil.disk_usage(folder).free
    except (psutil.Error, OSError):
        return None
    if free >= _ROOM_BYTES:
        return None
    return (
        f"every rank is gone, and its supervisor (pid {supervisor[0]}) waits for room on the full disk "
        f"under {folder} to write the run's end: free some space there and it ends (it waits "
        f"{ROOM_WAIT_S / 60:g} min at most, then ends with what it could write)"
    )


def lost_text(folder: str, call_id: str) -> str:
    """Why a detached run of this machine has no result: its supervisor is gone (one line)."""
    supervisor = _supervisor(folder)
    logs = (_read_state(folder) or {}).get("log_dir")
    return (
        f"detached run {call_id} was lost: its supervisor (pid {supervisor[0] if supervisor else '?'}) "
        "ended without a result, and its ranks with it. Its log: "
        f"{os.path.join(folder, SUPERVISOR_LOG)}" + (f"; the ranks' logs: {logs}" if logs else "")
    )


def follow_run(place: RunPlace, displays: list[Any], on_result: Any, more: Sequence[Any] = ()) -> RunHandle:
    """A handle on the run at ``place``, fed by a thread that replays and follows its events."""
    state = place.state()
    name, world = state.get("name", "?"), int(state.get("world_size", 1))
    pids: dict[int, int] = {}
    handle = RunHandle(
        name,
        world,
        stop=lambda grace_s=None, signum=None: place.cancel(),  # the supervisor's grace
        stacks=lambda: place.stacks(dict(pids), handle.log_dir),
        read_log=lambda rank: place.rank_log(rank, handle.log_dir),
        on_result=on_result,
        stop_grace=float(state.get("stop_grace", 0.0)),
        began=_began(state),
        why_not_ended=place.why_not_ended,
    )
    handle.detached_id = place.id
    handle.kind = state.get("kind", "function")
    show_displays(displays, world, name)
    consumers = [*displays, *more, handle]
    stop = threading.Event()

    caught_up = threading.Event()  # the replay reached the end of what was written so far

    def follow_events() -> RunFinished | None:
        started = time.monotonic()
        last_tick = 0.0
        finished: RunFinished | None = None
        gone = False  # the supervisor died: read what it wrote to the end, then stop
        linked = False  # its RecordLink came (a run of an older version has it in state.json only)
        for event in event_log.follow(lambda part: place.lines_of(part, stop), place.replay_from(), stop):
            now = time.monotonic()
            if event is None:
                if gone:
                    break
                if not caught_up.is_set() and not place.alive():
                    gone = True  # lost before we came: read it to the end, then say so (never "running")
                    continue
                caught_up.set()
            else:
                linked = linked or isinstance(event, RecordLink)
                if isinstance(event, RunStarted) and not linked:
                    record = record_in_state(place.state())
                    if record is not None:
                        _emit(consumers, record)
                    linked = True
                if isinstance(event, RankStarted):
                    pids[event.rank] = event.pid
                elif isinstance(event, RankExited):
                    pids.pop(event.rank, None)  # its pid may be reused: never signalled again
                if isinstance(event, RunFinished):  # shown once the result is read (follow())
                    finished = event
                    break
                _emit(consumers, event)
            if now - last_tick >= TICK_S:
                last_tick = now
                _emit(consumers, Tick(elapsed=now - started))
                if event is None and not place.alive():
                    gone = True
        return finished

    def follow() -> None:
        try:
            finished = follow_events()
            if stop.is_set() and finished is None:  # unfollow(): the run goes on; this handle ends here
                caught_up.set()
                return
            result, error, lost = _outcome(place, finished)
            outcome: tuple[RunResult | None, BaseException | None] = (result, error)
            # A supervisor gone without a result: the run is lost, whatever its last event said (a
            # display would otherwise say "succeeded in 41.4 s", then the handle "no result").
            if finished is not None and not lost:
                _emit(consumers, finished)
        except Exception as exc:  # noqa: BLE001 - a follower never dies with its handle unfinished
            outcome = (None, LaunchError(f"following detached run {handle.detached_id} failed: {exc!r}"))
        handle._finish(*outcome)
        caught_up.set()  # after: an attach to a run that has ended returns a handle that knows it

    handle.unfollow = stop.set  # type: ignore[attr-defined]
    start_in_context(follow, f"air_magic-follow-{name}")
    _followed.append(handle)
    # Back once what was written so far is replayed: the handle knows the log folder, the ranks'
    # pids and their states (stacks() and status answer at once), and the view shows it all.
    caught_up.wait(REPLAY_WAIT_S)
    return handle


def _began(state: dict[str, Any]) -> float | None:
    """When the run began, on this process's monotonic clock (state.json keeps the wall clock)."""
    try:
        started = float(state["started"])
    except (KeyError, TypeError, ValueError):
        return None
    return time.monotonic() - max(0.0, time.time() - started)


_followed: list[RunHandle] = []  # the detached runs this process follows (never cancelled at its exit)


def followed() -> list[RunHandle]:
    """The detached runs this process follows that have not ended, oldest first."""
    _followed[:] = [h for h in _followed if not h.done() and h not in _unfollowed]
    return list(_followed)


_unfollowed: list[RunHandle] = []


def stop_following(handle: RunHandle) -> str:
    """Stop following a detached run here (the stop button, Ctrl-C): it goes on. What to do next."""
    unfollow = getattr(handle, "unfollow", None)
    if unfollow is not None:
        unfollow()
    _unfollowed.append(handle)
    run = handle.detached_id
    return (
        f"stopped following detached run {run}; it goes on. Follow it again: air_magic.attach({run!r}) "
        f"(%distributed attach {run}, air-magic attach {run}); stop it: .cancel() on that handle "
        f"(air-magic cancel {run})"
    )


def record_in_state(state: dict[str, Any]) -> RecordLink | None:
    """The MLflow run as state.json names it: a run started by an older version (before its event
    log carried the RecordLink event) is shown with its link all the same."""
    run_id = state.get("mlflow_run_id")
    if not isinstance(run_id, str) or not run_id:
        return None
    url = state.get("mlflow_url")
    return RecordLink(run_id, str(state.get("mlflow") or ""), url if isinstance(url, str) else None)


def _emit(consumers: list[Any], event: Event) -> None:
    for consumer in list(consumers):
        try:
            consumer.handle(event)
        except Exception:  # noqa: BLE001 - a display must never stop the following
            consumers.remove(consumer)


def _outcome(
    place: RunPlace, finished: RunFinished | None
) -> tuple[RunResult | None, BaseException | None, bool]:
    """The run's result, once the supervisor has written it (after the ranks, it ends the MLflow
    run, which may take a while); or, once it is gone without one, why there is none. Last: lost
    (the supervisor went without writing one)."""
    try:
        result = place.result()
    except Exception as exc:  # noqa: BLE001 - the handle must end, and say why it has no result
        state = place.state()
        return (
            None,
            LaunchError(
                f"detached run {place.id} ended ({state.get('status', '?')}), but its result "
                f"could not be read here: {type(exc).__name__}: {exc}. Its logs: {state.get('log_dir')}"
            ),
            False,
        )
    if result is None:
        return None, LaunchError(place.lost()), True
    return result, None, False


def _signal_supervisor(folder: str) -> None:
    """Cancel: the mark first (a supervisor still starting reads it), then SIGTERM once its handler
    is in place (its ``listening`` mark): before that, SIGTERM's default would kill it unrecorded."""
    import signal

    try:
        private_files.create_private_file(os.path.join(folder, paths.DETACHED_CANCEL))
    except OSError:  # a full disk (no inode left): the signal alone reaches a listening supervisor
        pass
    supervisor = _supervisor(folder)
    if supervisor is not None and _supervisor_alive(folder):
        try:
            os.kill(supervisor[0], signal.SIGTERM)
        except ProcessLookupError:
            pass


def _check_ours(folder: str) -> None:
    try:
        info = os.stat(folder, follow_symlinks=False)
    except PermissionError:
        raise ConfigurationError(f"detached run {folder} is not yours to attach to") from None
    if info.st_uid != os.getuid():
        raise ConfigurationError(f"detached run {folder} belongs to another user: refusing to attach")


# -- state.json -----------------------------------------------------------------------------


def _state_of(folder: str) -> dict[str, Any]:
    """The run's state.json, or what can be told of it without one (a torn or missing file)."""
    return _read_state(folder) or _recovered_state(folder) or {}


RECOVER_BYTES = 1 << 16  # how much of the event log a torn state.json's run is recovered from


def _recovered_state(folder: str) -> dict[str, Any] | None:
    """A run whose state.json cannot be read (torn): what its folder still says (the supervisor's
    mark, the event log's RunStarted, a result), so that runs() lists it and attach() finds it."""
    supervisor = _supervisor(folder)
    state: dict[str, Any] = {"id": os.path.basename(folder), "name": "?", "world_size": 0}
    try:
        state["started"] = supervisor[1] if supervisor else os.stat(folder).st_mtime
        with open(os.path.join(folder, EVENTS), errors="replace") as f:
            head = f.read(RECOVER_BYTES)
    except OSError:
        head = ""
    for line in head.splitlines():
        event = event_log.from_line(line)
        if isinstance(event, RunStarted):
            state.update(name=event.name, world_size=event.world_size, log_dir=event.log_dir)
            break
    if supervisor is None and "log_dir" not in state and not os.path.exists(os.path.join(folder, REQUEST)):
        return None  # not a run's folder (nothing of a run in it)
    if os.path.exists(os.path.join(folder, RESULT)):
        state["status"] = Outcome.UNKNOWN  # it ended; how, only its result says
    else:
        state["status"] = Outcome.RUNNING  # lost, unless its supervisor still lives (_read_run)
    return state


def _read_state(folder: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(folder, STATE)) as f:
            state: dict[str, Any] = json.load(f)
            return state
    except (OSError, ValueError):
        return None


def write_state(folder: str, state: dict[str, Any]) -> None:
    wire.write_atomically(os.path.join(folder, STATE), json.dumps(state).encode())


def update_state(folder: str, **changes: Any) -> None:
    """Change some fields of the run's state.json (the supervisor, its only writer once it runs)."""
    state = _state_of(folder)  # a torn file: what the folder still says, not nothing
    state.update(changes)
    write_state(folder, state)


def live_gpu_uuids() -> dict[str, str]:
    """GPU uuid -> the detached run (of any kernel of this user) still running on it."""
    held: dict[str, str] = {}
    if not os.path.isdir(paths.state_dir(paths.DETACHED_DIR)):  # no detached run ever: nothing to read
        return held
    try:
        listed = runs()
    except (ConfigurationError, OSError):
        return held
    for run in listed:
        if run.status in _LIVE:
            for uuid in (_read_state(run.folder) or {}).get("gpus", []):
                held[uuid] = f"detached run {run.id} ({run.name})"
    return held


def _prune() -> None:
    """Keep the newest KEEP_ENDED ended runs' folders (a running one is never removed)."""
    ended = [r for r in runs() if r.status not in _LIVE]
    for run in ended[KEEP_ENDED:]:
        shutil.rmtree(run.folder, ignore_errors=True)


class RunStateWriter:
    """The supervisor's consumer that keeps ``state.json`` current (log folder, ranks, outcome).

    A full disk never stops the call: the changes that could not be written wait and go with the
    next write that finds room (tried again at most every ``event_log.ROOM_POLL_S``; the supervisor
    waits for room at the end, :meth:`finish`)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._waiting: dict[str, Any] = {}
        self._tried = 0.0

    def handle(self, event: Event) -> None:
        changes: dict[str, Any] = {}
        if isinstance(event, RecordLink):  # the call's MLflow run, made before the first rank
            changes = dict(mlflow=event.description, mlflow_url=event.url, mlflow_run_id=event.run_id)
        elif isinstance(event, RunStarted):  # state.json's key for the call's id stays "run_id"
            changes = dict(status=Outcome.RUNNING, log_dir=event.log_dir, run_id=event.call_id)
        elif isinstance(event, RunFinished):
            outcome = Outcome.CANCELLED if event.outcome == Outcome.INTERRUPTED else event.outcome
            changes = dict(status=outcome, elapsed=event.elapsed, error=event.error)
        self._waiting.update(changes)
        if changes or (self._waiting and time.monotonic() - self._tried >= event_log.ROOM_POLL_S):
            self._write()

    def _write(self) -> bool:
        self._tried = time.monotonic()
        try:
            update_state(self.folder, **self._waiting)
        except OSError:  # a full disk: kept for the next try
            return False
        self._waiting.clear()
        return True

    def finish(self, wait_s: float) -> bool:
        """The call has ended: wait up to ``wait_s`` for room to write what still waits."""
        deadline = time.monotonic() + wait_s
        while self._waiting and not self._write() and time.monotonic() < deadline:
            time.sleep(event_log.ROOM_POLL_S)
        return not self._waiting
