"""A detached run's supervisor: one small process that runs one call for a kernel that may go away.

``python -m air_magic.calls.supervisor FOLDER``, started by ``calls/detached.py``
in a session of its own; or ``python -m air_magic.calls.supervisor --ray-job RUN``,
a Ray job's entrypoint on its cluster (``calls/ray_jobs.py`` submits it): then
the ranks run through the Ray backend, the request comes with the job, and the
folder is in the Ray session's logs on the job's node, where followers on any
machine read it through the dashboard (Ray's job stop is the SIGTERM below).

It reads the call from ``FOLDER/request.pkl`` (and
deletes it: the arguments in clear) and runs it as a kernel would, through the
same ``PreparedCall.run``: fresh ranks (a warm starter belongs to its kernel),
the call's log folder, its MLflow run with the batched metric writer, every
event appended to ``events.jsonl`` and the state to ``state.json``. At the end
it writes ``result.pkl`` (values or error) and ends the MLflow run with the
outcome. SIGTERM or SIGINT (``cancel()`` from any attached handle) stops the
ranks as an interrupt would; SIGHUP is ignored. If the supervisor is killed,
its ranks die with it (their lifeline), and the next call of any kernel marks
its MLflow run KILLED.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from typing import Any

from air_magic import paths  # the standard library only: cheap before the handlers
from air_magic.protocol.events import Outcome

# A cancel may come while this process is still importing (a second or two): it is remembered
# from the first moment, not left to SIGTERM's default action (which would leave the run 'lost').
_stop_asked = threading.Event()
_stop_now: list[Any] = []  # the backend's stop(), once there is a backend


def _on_stop_signal(signum: int, frame: Any) -> None:
    _stop_asked.set()
    for stop in _stop_now:
        stop()


if __name__ == "__main__":  # before the imports below: they take the time a cancel may come in
    signal.signal(signal.SIGTERM, _on_stop_signal)
    signal.signal(signal.SIGINT, _on_stop_signal)
    # SIGHUP keeps its default: in a session of its own the supervisor has no terminal to lose,
    # and its ranks inherit what it has (an ignored SIGHUP would differ from a foreground call's).
    # From now on a SIGTERM is a cancel; before, cancel() only leaves its mark (detached.py).
    # Its pid and start time, written by itself (no other process writes them, so none can race it).
    # A Ray job has none: Ray reports whether its entrypoint lives.
    if sys.argv[1] != "--ray-job":
        import psutil

        me = f"{os.getpid()} {psutil.Process().create_time()}"
        mark = os.path.join(sys.argv[1], paths.DETACHED_LISTENING)
        fd = os.open(mark + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        os.write(fd, me.encode())
        os.close(fd)
        os.replace(mark + ".tmp", mark)

from air_magic.backends.base import Backend  # noqa: E402
from air_magic.backends.local.backend import LocalBackend  # noqa: E402
from air_magic.calls import detached, runners  # noqa: E402
from air_magic.calls.call import PreparedCall  # noqa: E402
from air_magic.launch.request import RunResult  # noqa: E402
from air_magic.launch.settings import LaunchSettings, make_settings  # noqa: E402
from air_magic.outcome import result_text  # noqa: E402
from air_magic.protocol import event_log, serialization, wire  # noqa: E402
from air_magic.protocol.events import Consumer, RunFinished  # noqa: E402
from air_magic.tracking import run as tracking  # noqa: E402

# The supervisor's exit status says how the call ended: a Ray job's status follows it (FAILED
# unless it succeeded) and its followers read the outcome from it (calls/ray_jobs.py).
EXIT_STATUS = result_text.SUPERVISOR_EXIT
EXIT_BEFORE_THE_CALL = result_text.EXIT_BEFORE_THE_CALL


class _BestEffort:
    """The supervisor's stdout or stderr (supervisor.log, in the run's folder): on a full disk a
    line is lost, never raised into the call (a warning, a consumer's report)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except OSError:
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError:
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: list[str]) -> int:
    """Run the call in folder ``argv[0]`` (or Ray job ``argv[1]``); whatever goes wrong, leave a
    result that says so."""
    if argv[0] == "--ray-job":
        return _main_job(argv[1])
    folder = argv[0]
    sys.stdout, sys.stderr = _BestEffort(sys.stdout), _BestEffort(sys.stderr)
    try:
        return _supervise(folder, _take_request(folder), LocalBackend(warm_start=False))
    except BaseException as exc:  # noqa: BLE001 - before the call ran: the attached handles learn why
        return _failed_before_the_call(folder, exc)


def _main_job(call_id: str) -> int:
    from air_magic.backends.ray import placement
    from air_magic.backends.ray.backend import RayBackend
    from air_magic.calls import ray_jobs

    placement.name_agents(call_id)  # a follower elsewhere asks them for stacks (backends/ray/job_stacks.py)

    # ray.init() puts Ray's own SIGTERM handler in place (it logs and exits): a stop that comes
    # meanwhile waits (blocked), then reaches ours, so Ray's stop_job is a cancel here as a local
    # supervisor's SIGTERM is.
    stops = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    try:
        folder, log_root = ray_jobs.job_folders(call_id)  # connects to the job's cluster
    finally:
        signal.signal(signal.SIGTERM, _on_stop_signal)
        signal.signal(signal.SIGINT, _on_stop_signal)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
    try:
        request = ray_jobs.take_request(call_id)
        detached.write_state(folder, {**request.state, "started": time.time()})
        # The cluster it runs on (RAY_ADDRESS, set by Ray); rank logs where the dashboard serves them.
        settings = make_settings(request.settings_raw, cluster="ray", detach=False, log_dir=log_root)
        return _supervise(folder, request, RayBackend(warm_start=settings.warm_start), settings)
    except BaseException as exc:  # noqa: BLE001 - before the call ran: the followers learn why
        return _failed_before_the_call(folder, exc, text=True)


def _failed_before_the_call(folder: str, exc: BaseException, text: bool = False) -> int:
    detached.update_state(folder, status=Outcome.FAILED, error=f"{type(exc).__name__}: {exc}")
    _write_result(folder, RunResult("", "", Outcome.FAILED, error=exc), text)
    return EXIT_BEFORE_THE_CALL


def _take_request(folder: str) -> detached.DetachedRequest:
    request_path = os.path.join(folder, detached.REQUEST)
    data = wire.read_bytes(request_path)
    os.unlink(request_path)
    assert data is not None, f"no request in {folder}"
    request: detached.DetachedRequest = serialization.loads(data)
    sys.path[:] = request.sys_path  # the caller's: its results may need its modules to load
    return request


def _supervise(
    folder: str, request: detached.DetachedRequest, backend: Backend, settings: LaunchSettings | None = None
) -> int:
    """Run the call; ``settings`` given: a Ray job's, placed here (the submitter placed nothing)."""
    sys.argv[:] = request.argv
    replan = settings is not None
    settings = settings if settings is not None else make_settings(request.settings_raw)
    plan = backend.prepare(settings)
    _stop_now.append(backend.stop)
    if _stop_asked.is_set() or os.path.exists(os.path.join(folder, paths.DETACHED_CANCEL)):
        backend.stop()  # cancelled while this process started: the call ends at once
    facts = request.facts
    if replan:
        detached.update_state(folder, world_size=plan.world_size)
        facts = dataclasses.replace(facts, plan=plan) if facts is not None else None
    else:
        plan = request.plan  # the GPUs the caller claimed for it (state.json names them)

    run_owner = tracking.TrackedRunOwner(facts, log_root=settings.log_dir) if facts else None
    if run_owner is not None:
        run_owner.remember_active(request.active)  # the caller's active run: the call's run nests in it
    prepared = PreparedCall(
        request.name,
        settings,
        backend,
        plan,
        request.payload,
        run_owner,
        None,
        runners.InThisProcess(backend),  # the supervisor is where it runs
        kind=request.kind,
        call_id=os.path.basename(folder),  # one id for the run: its folder here, its log folder, runs()
    )
    # State first, events last: whoever reads an event finds the state (the MLflow run) it implies.
    state, events = detached.RunStateWriter(folder), event_log.EventLogWriter(folder)
    consumers: list[Consumer] = [state, events]
    try:
        result = prepared.run([], consumers)
    except BaseException as exc:  # noqa: BLE001 - handed to whoever attaches
        result = RunResult("", "", Outcome.FAILED, error=exc)
        state.handle(RunFinished("", Outcome.FAILED, 0.0, "", f"{type(exc).__name__}: {exc}"))
    # A full disk under the folder: what waits goes once there is room (the result last).
    deadline = time.monotonic() + detached.ROOM_WAIT_S
    events.finish(detached.ROOM_WAIT_S)
    state.finish(max(0.0, deadline - time.monotonic()))
    _until_room(lambda: _write_result(folder, result, text=replan), deadline)
    return EXIT_STATUS.get(result.outcome, EXIT_STATUS[Outcome.FAILED])


def _until_room(write: Any, deadline: float) -> None:
    """``write()``, tried again while the disk is full, until ``deadline`` (then its error)."""
    while True:
        try:
            return write()
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(event_log.ROOM_POLL_S)


def _kept_as_text(result: RunResult, exc: Exception) -> RunResult:
    """``result`` as something that surely pickles: its error as text (its type, message and
    rank's traceback), or, for values that cannot travel, an error that says so."""
    from air_magic.errors import PayloadError, RankFailedError, RemoteTraceback

    error = result.error
    if error is None:
        kept: BaseException = PayloadError(
            f"the run ended ({result.outcome}) but its result could not be kept: {exc}"
        )
        return RunResult(result.call_id, result.log_dir, Outcome.FAILED, error=kept)
    cause = error.__cause__ if isinstance(error.__cause__, RemoteTraceback) else None
    kept = RankFailedError(
        f"{type(error).__module__}.{type(error).__qualname__}: {error}\n"
        f"(the exception itself could not be kept for whoever attaches: {exc})",
        rank=getattr(error, "air_magic_rank", getattr(error, "rank", -1)),
        log_dir=result.log_dir,
        remote_traceback=cause.text if cause is not None else None,
    )
    kept.__cause__ = cause
    return RunResult(result.call_id, result.log_dir, result.outcome, error=kept)


def _write_result(folder: str, result: RunResult, text: bool = False) -> None:
    """``result.pkl``; ``text``: ``result.json`` (outcome/result_text.py), for followers that read it
    over HTTP and unpickle nothing."""
    if text:
        wire.write_atomically(os.path.join(folder, paths.DETACHED_RESULT_TEXT), result_text.to_json(result))
        return
    try:
        data = serialization.dumps(result)
        if result.error is not None:  # what a follower will do: an error that pickles may not load
            serialization.loads(serialization.dumps(result.error))
    except Exception as exc:  # noqa: BLE001 - a value that cannot be pickled again: say so
        data = serialization.dumps(_kept_as_text(result, exc))
    wire.write_atomically(os.path.join(folder, detached.RESULT), data)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
