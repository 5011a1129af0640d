"""Detached runs on a Ray cluster: each a Ray job, submitted and followed from any machine.

``detach=True`` with ``cluster="ray"`` (``air-magic run --cluster ray=ADDRESS --detach``)
comes here from ``calls/runners.RayJob`` instead of ``calls/detached.py``'s local
supervisor. :func:`submit` hands the prepared call to Ray's Jobs API and returns
once the job is accepted; the submitting process may then exit::

    submitter                               the cluster (Ray job <run id>)
    request.pkl in a py_modules folder ---> python3 -m air_magic.calls.supervisor --ray-job RUN
    (working_dir: this folder, for a           ray.init() to the cluster, the call on the Ray backend
    script or module)                          <session>/logs/air_magic/jobs/RUN/: state.json,
                                               events*.jsonl, result.b64; rank logs in
                                               <session>/logs/air_magic/RUN/

Whoever follows -- this process, or ``air-magic attach RUN`` on another machine
with ``RAY_ADDRESS`` (or ``--cluster ray=ADDRESS``) and no local state -- reads
those files through the dashboard (``backends/ray/jobs_api.py``): a
:class:`JobRun` is the same ``RunPlace`` a local folder is, so attach, runs,
logs and cancel behave as they do for a local detached run. Cancel is Ray's
``stop_job``: SIGTERM to the supervisor, which stops the ranks as an interrupt
would. Who can see and cancel a run: anyone who can reach the cluster's Jobs
API (docs/ray.md says how to limit that).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import secrets
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from air_magic import paths, private_files
from air_magic._version import __version__
from air_magic.backends.ray import job_stacks, jobs_api
from air_magic.calls import detached
from air_magic.calls.background import RunHandle
from air_magic.display.widgets import make_consumers
from air_magic.errors import ConfigurationError, LaunchError
from air_magic.launch.request import RunResult, new_call_id
from air_magic.outcome import result_text
from air_magic.protocol import env_names, event_log, serialization
from air_magic.protocol.events import Outcome

MARK = "air_magic"  # the jobs' metadata key that tells air_magic's runs from other Ray jobs
JOBS_FOLDER = "jobs"  # <session>/logs/air_magic/jobs/<run>/: a run's state, events and result
ENTRYPOINT_PYTHON = "python3"  # the cluster's, with Ray and air_magic (else AIR_MAGIC_RAY_JOB_PYTHON)
STOP_MARGIN_S = 30  # beyond the ranks' stop grace, before Ray kills a cancelled job's supervisor
UNREACHABLE_S = 30.0  # a follower keeps going this long while the dashboard does not answer
STACKS_JOB_WAIT_S = 90.0  # the stacks helper job: its start, its driver's, every node's dumps (30 s)
POLL_S = 0.5  # how often a follower asks the Jobs API whether the job still runs
_LIVE_JOB = ("PENDING", "RUNNING")


# -- the submitting side -------------------------------------------------------------------


def submit(
    prepared: Any, client: Any, address: str | None, on_result: Any = None, consumers: Sequence[Any] = ()
) -> RunHandle:
    """Submit ``prepared`` as a Ray job through ``client`` (the cluster's Jobs API at ``address``,
    checked by ``calls/runners.RayJob.prepare``); follow it here. Returns once the job is accepted."""
    call_id = new_call_id()
    request = detached.request_for(prepared)
    state = detached.first_state(call_id, prepared)
    env = _job_env()
    # The grace as resolved here (TORCH_ELASTIC_SHUTDOWN_TIMEOUT...), so the cluster's is the same;
    # the caller's active MLflow run only where its store goes with the job.
    raw = {**request.settings_raw, "stop_grace": state["stop_grace"]}
    active = request.active if "MLFLOW_TRACKING_URI" in env else None
    request = dataclasses.replace(request, state=state, sys_path=[], settings_raw=raw, active=active)
    # Ray's stop_job: SIGTERM to the supervisor, then SIGKILL after this many seconds (an integer):
    # the ranks' stop grace and the supervisor's own end (the MLflow run, the result) fit in it.
    grace = {"RAY_JOB_STOP_WAIT_TIME_S": str(int(state["stop_grace"]) + STOP_MARGIN_S)}
    version = {env_names.SUBMITTED_WITH: __version__}  # the request is a pickle of this version's classes
    runtime_env: dict[str, Any] = {"env_vars": {**env, **grace, **version}}
    if prepared.kind in ("script", "module", "program"):
        runtime_env["working_dir"] = os.getcwd()  # the code beside it travels (Ray's rules: .gitignore...)
    try:
        with tempfile.TemporaryDirectory(prefix="air_magic-job-") as scratch, _quiet_uploads():
            carried = os.path.join(scratch, request_module(call_id))
            os.mkdir(carried, 0o700)
            with open(os.path.join(carried, paths.DETACHED_REQUEST), "wb") as f:
                f.write(serialization.dumps(request))
            runtime_env["py_modules"] = [carried]
            # exec: the supervisor is the process Ray watches and stops, not a shell above it.
            entrypoint = f"exec {job_python()} -m air_magic.calls.supervisor --ray-job {shlex.quote(call_id)}"
            client.submit_job(
                entrypoint=entrypoint,
                submission_id=call_id,
                runtime_env=runtime_env,
                metadata=_metadata(state),
            )
    finally:
        prepared.abandon()
    place = JobRun(client, call_id, address=address)
    return detached.follow_run(place, make_consumers(prepared.settings.display), on_result, consumers)


@contextlib.contextmanager
def _quiet_uploads() -> Iterator[None]:
    """Ray's client logs each package it uploads at INFO on stderr: the command says what matters."""
    names = ("ray.dashboard.modules.dashboard_sdk", "ray._private.runtime_env.packaging")
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def job_python() -> str:
    """The command that runs Python on the cluster, for a job's entrypoint (a shell word or path)."""
    return shlex.quote(os.environ.get(env_names.RAY_JOB_PYTHON) or ENTRYPOINT_PYTHON)


def request_module(call_id: str) -> str:
    """The name the request's folder travels under (a Ray ``py_modules`` entry is importable)."""
    return "air_magic_request_" + call_id.replace("-", "_")


def _metadata(state: dict[str, Any]) -> dict[str, str]:
    fields = ("name", "kind", "world_size", "stop_grace")
    return {MARK: "1", **{f"{MARK}_{k}": str(state.get(k, "")) for k in fields}}


def _job_env() -> dict[str, str]:
    """The caller's MLflow choices that mean something on the cluster: a tracking server, the
    experiment. An embedded store is a file here: the job uses the cluster's own default."""
    env = detached.supervisor_env()
    kept = {k: env[k] for k in ("MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME") if env.get(k)}
    uri = env.get("MLFLOW_TRACKING_URI", "")
    if uri.startswith(("http://", "https://", "databricks")):
        kept["MLFLOW_TRACKING_URI"] = uri
    return kept


# -- the cluster side (the job's supervisor) -----------------------------------------------


def job_folders(call_id: str) -> tuple[str, str]:
    """Connect to the job's cluster; (this run's folder, the rank logs' root) in the Ray session's
    logs folder on this node, where the dashboard serves them."""
    from air_magic.backends.ray import cluster

    ray = cluster.connect()  # RAY_ADDRESS: Ray sets it for a job's entrypoint
    node = ray._private.worker._global_node
    logs = node.get_logs_dir_path()
    # Ray's own folders, 0777 (Ray's temp folder, the session's, its logs): the dashboard serves
    # only what is under the logs folder, to whoever reaches it.
    for folder in (node.get_temp_dir_path(), node.get_session_dir_path(), logs):
        private_files.accept_shared_folder(folder)
    root = private_files.private_root(
        os.path.join(logs, jobs_api.LOGS_SUBFOLDER), "the Ray job's log folder", "Remove it"
    )
    folder = os.path.join(private_files.private_subfolder(os.path.join(root, JOBS_FOLDER)), call_id)
    os.mkdir(folder, 0o700)
    return folder, root


def take_request(call_id: str) -> detached.DetachedRequest:
    """The request that came with the job (its ``py_modules`` folder), if this air_magic can read it."""
    submitted_with = os.environ.get(env_names.SUBMITTED_WITH)
    if submitted_with is not None and submitted_with != __version__:
        raise ConfigurationError(
            f"run {call_id} was submitted with air_magic {submitted_with}, but the cluster's Python "
            f"({sys.executable}) has air_magic {__version__}: install the same version on the cluster's "
            f"nodes (or point {env_names.RAY_JOB_PYTHON} at a Python that has it), then submit again"
        )
    spec = importlib.util.find_spec(request_module(call_id))
    if spec is None or not spec.submodule_search_locations:
        raise LaunchError(f"the request of run {call_id} did not come with its job (py_modules)")
    folder = next(iter(spec.submodule_search_locations))
    with open(os.path.join(folder, paths.DETACHED_REQUEST), "rb") as f:
        request: detached.DetachedRequest = serialization.loads(f.read())
    return request


# -- following from anywhere ---------------------------------------------------------------


class JobRun:
    """A detached run that is a Ray job, read through the cluster's dashboard (a ``RunPlace``)."""

    def __init__(self, client: Any, call_id: str, info: Any = None, address: str | None = None) -> None:
        self.client = client
        self.id = call_id
        self.address = address
        self._info = info
        self._checked = time.monotonic() if info is not None else 0.0
        self._lock = threading.Lock()

    # -- the job, as Ray reports it

    def info(self, fresh: bool = False) -> Any:
        """The job's details (at most POLL_S old); the last ones while the dashboard does not answer
        for up to UNREACHABLE_S (a network's blip must not end a follower)."""
        with self._lock:
            if fresh or self._info is None or time.monotonic() - self._checked > POLL_S:
                try:
                    self._info = self.client.get_job_info(self.id)
                    self._checked = time.monotonic()
                except Exception:
                    if self._info is None or time.monotonic() - self._checked > UNREACHABLE_S:
                        raise
            return self._info

    def _node(self) -> str | None:
        return getattr(self.info(), "driver_node_id", None) or None

    def _file(self, name: str) -> str:
        return f"{jobs_api.LOGS_SUBFOLDER}/{JOBS_FOLDER}/{self.id}/{name}"

    def alive(self) -> bool:
        return _status_name(self.info()) in _LIVE_JOB

    @property
    def status(self) -> str:
        return run_status(self.info(fresh=True))

    # -- RunPlace

    def state(self) -> dict[str, Any]:
        """What the job was submitted as (its metadata), then its state.json once it runs."""
        state = {"id": self.id, **_submitted(self.info())}
        node = self._node()
        if node is not None:
            data = jobs_api.read_file(self.client, node, self._file(paths.DETACHED_STATE))
            if data:
                try:
                    state.update(json.loads(data))
                except ValueError:
                    pass
        return state

    def replay_from(self) -> int:
        node = self._node()
        if node is None:  # not started: it will write from the first part
            return 0
        return event_log.replay_from(jobs_api.list_files(self.client, node, self._file("events*.jsonl")))

    def lines_of(self, part: int, stop: threading.Event) -> event_log.Lines:
        """The part's lines: what is written so far (one read), then ``None`` (caught up), then new
        lines through the dashboard's stream, opened again past what was read if it drops. Once the
        job has ended, the rest is read whole and the lines end: a ``None`` here never means the end."""
        name = self._file(event_log.part_name(part))
        read = 0

        def rest(node: str) -> list[str]:
            nonlocal read
            data = jobs_api.read_file(self.client, node, name) or b""
            lines = data.decode("utf-8", "replace").splitlines(keepends=True)
            if lines and not lines[-1].endswith("\n"):
                lines.pop()  # still being written: the stream gives it whole
            new, read = lines[read:], max(read, len(lines))
            return new

        node = self._node()
        while node is None:  # not started yet: nothing to replay, so None (caught up) until it runs
            if stop.is_set() or not self.alive():
                return  # ended before it ran: no lines
            yield None
            time.sleep(POLL_S)
            node = self._node()
        yield from rest(node)
        yield None  # caught up with what was written
        while not stop.is_set():
            seen = 0
            for line in jobs_api.stream_lines(self.client, node, name, stop):
                if line is None:
                    if not self.alive():
                        yield from rest(node)
                        return
                    yield None
                    continue
                seen += 1
                if seen > read:
                    read = seen
                    yield line
            if not self.alive():
                yield from rest(node)
                return
            yield None
            time.sleep(POLL_S)

    def result(self) -> RunResult | None:
        """The result (``result.json``: nothing is unpickled), once written -- the supervisor then
        ends the MLflow run and exits; None if the job ended without one."""
        while True:
            alive = self.alive()  # before the read: a result written before the end is then seen
            node = self._node()
            data = (
                jobs_api.read_file(self.client, node, self._file(paths.DETACHED_RESULT_TEXT))
                if node
                else None
            )
            if data:
                try:
                    return result_text.from_json(data)
                except (ValueError, KeyError):
                    pass  # being written: write_atomically makes that rare
            if not alive:
                if _status_name(self.info(fresh=True)) == "STOPPED":  # cancelled before its supervisor ran
                    said = f"Ray job {self.id} was cancelled before its ranks started; nothing ran"
                    return RunResult(self.id, "", Outcome.INTERRUPTED, error=LaunchError(said))
                return None
            time.sleep(POLL_S)

    def lost(self) -> str:
        info = self.info(fresh=True)
        said = f": {info.message}" if getattr(info, "message", None) else ""
        return (
            f"Ray job {self.id} ended ({_status_name(info)}{said}) without a result; its ranks ended with "
            "it (a job's agents and ranks go with its supervisor). Its log: ray job logs " + self.id
        )

    def cancel(self) -> None:
        if self.alive():
            self.client.stop_job(self.id)

    def why_not_ended(self) -> str | None:
        """None: a stopped job ends when its ranks do (Ray holds its record, not a disk of ours)."""
        return None

    def stacks(self, pids: dict[int, int], log_dir: str | None) -> dict[int, str]:
        """The ranks' stacks, taken on their nodes by a small helper job (``job_stacks``): a running
        job has no other way in. Seconds (the helper joins the cluster as a driver); the helper is
        gone from the cluster's job list after, however this ends."""
        if not pids or not self.alive():
            return {}
        helper = f"{self.id}-stacks-{secrets.token_hex(3)}"
        self.client.submit_job(
            entrypoint=f"exec {self._python()} -m {job_stacks.__name__} {shlex.quote(self.id)}",
            submission_id=helper,
            metadata={f"{MARK}_helper": "stacks"},  # not a run: runs() lists only MARK's
        )
        log = None
        try:
            deadline = time.monotonic() + STACKS_JOB_WAIT_S
            while log is None and time.monotonic() < deadline:
                with contextlib.suppress(Exception):  # the dashboard's blip: ask again
                    if _status_name(self.client.get_job_info(helper)) not in _LIVE_JOB:
                        log = self.client.get_job_logs(helper)
                        continue
                time.sleep(0.2)
        finally:
            _remove_job(self.client, helper)
        if log is None:
            why = f"the helper job {helper} took over {STACKS_JOB_WAIT_S:g} s"
        else:
            found = job_stacks.parse(log)
            if found:
                return found
            last = "\n".join(log.strip().splitlines()[-5:])
            why = (
                f"the helper job {helper} found no rank of the run running (they ended, or its "
                "supervisor is an air_magic that does not name its agents)"
                if found == {}
                else f"the helper job {helper} failed:\n{last}"
            )
        return {rank: f"(no stack: {why})" for rank in pids}

    def _python(self) -> str:
        """The Python the run's own job was started with (the submitter's choice), else this
        machine's setting: a follower elsewhere may not have the submitter's setting."""
        words = shlex.split(getattr(self.info(), "entrypoint", None) or "")
        return shlex.quote(words[1]) if len(words) > 1 and words[0] == "exec" else job_python()

    def logs_folder(self) -> str:
        """The rank logs' folder, relative to the Ray session's logs folder on the job's node."""
        return f"{jobs_api.LOGS_SUBFOLDER}/{self.id}"

    def rank_log(self, rank: int, log_dir: str | None = None) -> str:
        """Rank ``rank``'s log, read from the job's node ('' while it has none)."""
        return self.rank_log_file(rank) or ""

    def rank_log_file(self, rank: int) -> str | None:
        """Rank ``rank``'s log as read from the job's node; None where there is no such file."""
        node = self._node()
        data = (
            jobs_api.read_file(self.client, node, paths.rank_log(self.logs_folder(), rank)) if node else None
        )
        return None if data is None else data.decode("utf-8", "replace")

    def as_listed(self) -> detached.DetachedRun:
        info = self.info()
        submitted = _submitted(info)
        status = run_status(info)
        if status == "running":  # its call may have ended while the supervisor still ends its run
            said = self.state().get("status")
            status = str(said) if said in result_text.RUN_STATUS_OF_EXIT.values() else status
        return detached.DetachedRun(
            id=self.id,
            name=submitted["name"],
            status=status,
            world_size=submitted["world_size"],
            started=submitted["started"],
            log_dir=None,
            folder=f"ray job {self.id}",
            pid=None,
            mlflow=None,
            cluster=self.address,
        )


def _remove_job(client: Any, job: str, wait_s: float = 30.0) -> None:
    """A helper job gone from the cluster's job list: stopped if it still runs, then deleted (Ray
    deletes only a job that has ended; a loaded machine may take tens of seconds to end one)."""
    with contextlib.suppress(Exception):
        client.stop_job(job)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            client.delete_job(job)
            return
        except Exception:  # noqa: BLE001 - still stopping; or gone, or the dashboard blinked
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)


def _submitted(info: Any) -> dict[str, Any]:
    """The facts :func:`_metadata` put in a job's metadata, and when it started."""
    meta = info.metadata or {}
    return {
        "name": meta.get(f"{MARK}_name", "?"),
        "kind": meta.get(f"{MARK}_kind", "function"),
        "world_size": _int(meta.get(f"{MARK}_world_size")),
        "stop_grace": float(meta.get(f"{MARK}_stop_grace") or 0.0),
        "started": (info.start_time or 0) / 1000,
    }


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _status_name(info: Any) -> str:
    status = getattr(info, "status", "")
    return str(getattr(status, "value", status))


def run_status(info: Any) -> str:
    """A job's run status, as ``runs()`` says it: starting, running, succeeded, failed, timeout,
    cancelled, or lost (its supervisor died without saying how the call ended)."""
    status = _status_name(info)
    if status == "PENDING":
        return "starting"
    if status == "RUNNING":
        return "running"
    if status == "STOPPED":
        return "cancelled"
    if status == "SUCCEEDED":
        return "succeeded"
    if not getattr(info, "driver_node_id", None) and getattr(info, "driver_exit_code", None) is None:
        return "failed"  # it never ran: its runtime environment, say (Ray's message says why)
    code = getattr(info, "driver_exit_code", None)
    return result_text.RUN_STATUS_OF_EXIT.get(code, "lost") if isinstance(code, int) else "lost"


def cluster_address(cluster: str | None = None) -> str | None:
    """The cluster a follower asks about: ``cluster`` ('ray=ADDRESS'), else ``$RAY_ADDRESS``; None
    when neither is given (or Ray is not installed here): then only this machine's runs."""
    if cluster:
        kind, _, address = cluster.partition("=")
        if kind != "ray":
            raise ConfigurationError(f"--cluster must be ray or ray=ADDRESS, got {cluster!r}")
        return address or os.environ.get("RAY_ADDRESS") or None
    address = os.environ.get("RAY_ADDRESS", "")
    # Only a dashboard's address: RAY_ADDRESS set for ray.init (host:6379, ray://) is not asked.
    if not address.startswith(("http://", "https://")) or importlib.util.find_spec("ray") is None:
        return None
    return address


def runs(address: str | None) -> list[detached.DetachedRun]:
    """The air_magic runs on the cluster at ``address``, newest first."""
    client = jobs_api.client_for(address)
    jobs = [j for j in client.list_jobs() if (j.metadata or {}).get(MARK) and j.submission_id]
    jobs.sort(key=lambda j: j.submission_id, reverse=True)
    return [JobRun(client, j.submission_id, j, address).as_listed() for j in jobs]


def find(run: str | None, address: str | None) -> JobRun:
    """The cluster's run ``run`` names (its id or the start of it; None: the newest running)."""
    client = jobs_api.client_for(address)
    jobs = [j for j in client.list_jobs() if (j.metadata or {}).get(MARK) and j.submission_id]
    jobs.sort(key=lambda j: j.submission_id, reverse=True)
    if run is None:
        live = [j for j in jobs if _status_name(j) in _LIVE_JOB]
        if not live:
            raise ConfigurationError("no air_magic run is running on the Ray cluster (runs lists them all)")
        return JobRun(client, live[0].submission_id, live[0], address)
    matches = [j for j in jobs if j.submission_id == run] or [
        j for j in jobs if j.submission_id.startswith(run)
    ]
    if len(matches) != 1:
        known = ", ".join(j.submission_id for j in jobs[:5]) or "none"
        what = "no" if not matches else "more than one"
        raise ConfigurationError(f"{what} run on the Ray cluster matches {run!r} (the newest: {known})")
    return JobRun(client, matches[0].submission_id, matches[0], address)


def attach(
    run: str | JobRun | None, address: str | None, display: str = "auto", consumers: Sequence[Any] = ()
) -> RunHandle:
    """Follow a run on the cluster from here: its output so far (the newest part), then live."""
    place = run if isinstance(run, JobRun) else find(run, address)
    on_result = detached.cell_values if place.state().get("kind") == "cell" else None
    return detached.follow_run(place, make_consumers(display), on_result, consumers)


def rank_log(run: str, rank: int | None, address: str | None, tail: int | None = None) -> str:
    """A rank's log (its last ``tail`` lines; ``rank`` None: the run's files), from the job's node."""
    place = find(run, address)
    node = place._node()
    if node is None:
        raise ConfigurationError(f"run {place.id} has not started on the cluster yet: no log so far")
    if rank is None:
        folder = place.logs_folder()
        names = jobs_api.list_files(place.client, node, f"{folder}/*")
        return "\n".join([f"ray job {place.id} ({folder}/ on its node)", *names])
    text = place.rank_log_file(rank)
    if text is None:
        raise ConfigurationError(f"rank {rank} has no log in run {place.id}")
    if tail is None:
        return text
    return "\n".join(text.splitlines()[-tail:]) + f"\n(full log: air-magic logs {place.id} {rank})"
