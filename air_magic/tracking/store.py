"""Where a call's run goes: the store (tracking URI), the experiment, and the store's upkeep.

- **Store.** The user's MLflow configuration wins: a tracking URI set with
  ``mlflow.set_tracking_uri`` or ``MLFLOW_TRACKING_URI``, or, when the notebook
  already has an active run or experiment, whatever store MLflow is using.
  Otherwise air_magic uses an embedded sqlite store that needs no server:
  ``$XDG_STATE_HOME/air_magic/mlflow/mlflow.db`` with artifacts beside it
  (``AIR_MAGIC_MLFLOW_DIR`` moves both). Processes open it one at a time
  (``flock`` on ``mlflow.db.lock``, :func:`setup_lock`): MLflow makes its tables
  on first open, and processes doing that at once fail.
- **Experiment.** ``experiment=`` (``--experiment``), else the notebook's active
  run's or active experiment, else ``MLFLOW_EXPERIMENT_ID`` /
  ``MLFLOW_EXPERIMENT_NAME``, else the notebook's name (from Jupyter's
  ``JPY_SESSION_NAME``) or the script's, else ``air_magic``.
- **A store that refuses writes** (a full disk): MLflow's store logs each failed
  statement at ERROR with its SQL and a traceback, about 30 lines a write. On
  air_magic's own threads that is dropped (:func:`quiet_store_errors`): the run
  says the refusal in one line of its own (run.py, metric_writer.py).
- **Runs whose caller died.** A process killed with SIGKILL cannot end its own
  run; the next process that tracks into the same store marks it KILLED, once,
  on its first call (:func:`end_orphaned_runs`).

Everything here that talks to MLflow runs on the run's owner thread
(run.py's :class:`~air_magic.tracking.run.TrackedRunOwner`), never on the caller's.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import socket
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from air_magic import paths, private_files
from air_magic.tracking import metric_rows, metric_writer
from air_magic.tracking.mlflow_import import import_mlflow

_reaped: set[str] = set()  # tracking URIs already checked for runs whose caller died
# How many RUNNING runs of this host one check looks at: more than one host ever has open (one
# per call in flight, per process); a store with more is cleaned over several processes' checks.
ORPHAN_SEARCH_LIMIT = 200


STORE_LOGGER = "mlflow.store.db.utils"  # where MLflow's sqlalchemy store logs a failed statement


class _NotOnOurThreads(logging.Filter):
    """Drop records logged on air_magic's threads (the user's own MLflow calls keep theirs)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.threadName or "").startswith("air_magic")


_QUIET = _NotOnOurThreads()


def quiet_store_errors() -> None:
    """MLflow's store says nothing of air_magic's own writes: a refusal is said once, in one line."""
    logger = logging.getLogger(STORE_LOGGER)
    if _QUIET not in logger.filters:
        logger.addFilter(_QUIET)


def current_uri() -> str:
    """The tracking URI the next call would use."""
    mlflow = import_mlflow()
    if mlflow is None:
        raise ImportError("mlflow could not be imported", name="mlflow")
    return tracking_uri(mlflow, mlflow.active_run())


def tracking_uri(mlflow: Any, active: Any) -> str:
    """The user's store when they chose one (or use one: an active run or experiment), else ours
    (prepared: :func:`prepare_embedded`)."""
    uri = chosen_uri(mlflow, active)
    if uri == paths.embedded_mlflow_uri():
        prepare_embedded()
    return uri


def chosen_uri(mlflow: Any, active: Any) -> str:
    """:func:`tracking_uri` without touching the embedded store's folder."""
    if _user_set_tracking_uri() or active is not None or active_experiment_id() is not None:
        return str(mlflow.get_tracking_uri())
    return paths.embedded_mlflow_uri()


def prepare_embedded() -> None:
    """The embedded store's folder checked, its files private, before MLflow opens it."""
    private_files.private_store(paths.embedded_mlflow_dir(), paths.MLFLOW_DB, [paths.MLFLOW_ARTIFACTS])


def unusable(uri: str) -> str | None:
    """Why the embedded store cannot take a run now (a folder it cannot write), or None; the
    embedded store prepared. Another store: None (its own requests say what is wrong with it).

    A folder that is not ours alone is refused with the :class:`ConfigurationError` of
    :func:`~air_magic.private_files.private_root` (a security refusal, not a reason to run untracked).
    """
    if uri != paths.embedded_mlflow_uri():
        return None
    folder = paths.embedded_mlflow_dir()
    if os.path.isdir(folder) and not os.access(folder, os.W_OK):
        return "is read-only"  # every tracked call would fail writing to it
    try:
        prepare_embedded()
    except OSError as exc:
        return f"cannot be written ({exc.strerror or exc}: {exc.filename or folder})"
    return None


def _user_set_tracking_uri() -> bool:
    """``mlflow.set_tracking_uri()`` was called, or ``MLFLOW_TRACKING_URI`` is set.

    MLflow's own answer is private (``is_tracking_uri_set``); without it only the variable is
    seen, and a notebook's ``set_tracking_uri()`` alone is missed (its calls then use the
    embedded store), said in a warning.
    """
    try:
        from mlflow.tracking._tracking_service.utils import is_tracking_uri_set
    except ImportError as exc:
        _warn(f"cannot tell whether set_tracking_uri() was called ({exc}); only MLFLOW_TRACKING_URI counts")
        return bool(os.environ.get("MLFLOW_TRACKING_URI"))
    return bool(is_tracking_uri_set())


def active_experiment_id() -> str | None:
    """The experiment the notebook chose with ``mlflow.set_experiment()``.

    MLflow keeps it in a private global; without it (a future MLflow), ``MLFLOW_EXPERIMENT_ID``,
    which ``set_experiment()`` also sets (a user's own value then counts as a choice too).
    """
    fluent = sys.modules.get("mlflow.tracking.fluent")
    if fluent is None:
        return None
    try:
        chosen = fluent._active_experiment_id
    except AttributeError:
        chosen = os.environ.get("MLFLOW_EXPERIMENT_ID") or None
    return None if chosen is None else str(chosen)


@contextlib.contextmanager
def setup_lock(uri: str) -> Iterator[None]:
    """For the embedded store: one process at a time opens it (``flock`` on ``mlflow.db.lock``).

    Opening a sqlite store makes and migrates MLflow's tables when they are missing or old;
    processes doing that at once fail (``table latest_metrics already exists``,
    ``duplicate column name``). Each process opens a store once (MLflow caches it), so
    the lock is taken once per process, and is over in milliseconds once the tables exist.
    """
    if uri != paths.embedded_mlflow_uri():
        yield
        return
    path = os.path.join(paths.embedded_mlflow_dir(), paths.MLFLOW_DB_LOCK)
    # 0600: the store's folder is the user's alone (docs/security.md), and so is what is in it.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def experiment_id(client: Any, uri: str, active: Any, explicit: str | None) -> str:
    """The call's experiment (see the module's docstring), created when it does not exist yet."""
    if explicit is None:
        if active is not None:
            return str(active.info.experiment_id)
        chosen = active_experiment_id()
        if chosen is not None:
            return chosen
        if os.environ.get("MLFLOW_EXPERIMENT_ID"):
            return os.environ["MLFLOW_EXPERIMENT_ID"]
    name = explicit or os.environ.get("MLFLOW_EXPERIMENT_NAME") or default_experiment_name()
    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    location = None
    if uri == paths.embedded_mlflow_uri():
        # Keep artifacts beside the embedded store, not in whatever the cwd is.
        location = "file://" + os.path.join(
            paths.embedded_mlflow_dir(), paths.MLFLOW_ARTIFACTS, safe_name(name)
        )
    try:
        return str(client.create_experiment(name, artifact_location=location))
    except Exception:  # another process may have created it first (re-raised below if not)
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return str(found.experiment_id)


_named_after: str | None = None  # what ``air-magic run`` runs (its process's __main__ is air-magic)


def name_calls_after(target: str) -> None:
    """Calls of this process default to the experiment ``target`` (a script's or notebook's stem,
    a module's name): the command line runs them, so its own ``__main__`` would name them."""
    global _named_after
    _named_after = target or None


def default_experiment_name() -> str:
    """The notebook's name, else the script's (or ``python -m``'s package), else ``air_magic``."""
    if _named_after is not None:
        return _named_after
    session = os.environ.get("JPY_SESSION_NAME")  # set by Jupyter for a notebook's kernel
    if session:
        return os.path.splitext(os.path.basename(session))[0] or "air_magic"
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or os.path.basename(path).startswith("ipykernel_launcher"):
        return "air_magic"
    stem = os.path.splitext(os.path.basename(path))[0]
    if stem == "__main__":  # python -m package: the package's name
        spec = getattr(main, "__spec__", None)
        stem = (getattr(spec, "parent", "") or "").split(".")[0] or "air_magic"
    return stem


def safe_name(name: str) -> str:
    """``name`` as one safe path component."""
    return re.sub(r"[^\w.-]+", "_", name).strip("_") or "run"


def caller_id() -> str:
    """This process, in a form that survives pid reuse: ``pid:start-time``."""
    import psutil

    me = psutil.Process()
    # Milliseconds: finer than the kernel's start-time clock (10 ms ticks), so the text is exact
    # and compares equal when read back from another process (end_orphaned_runs).
    return f"{me.pid}:{me.create_time():.3f}"


def end_orphaned_runs(client: Any, uri: str) -> None:
    """Once per store and process: mark KILLED the runs of this machine whose caller died mid-call.

    A process killed with SIGKILL (or a kernel restarted) cannot end its own run; the next
    process that tracks into the same store does it for it, once, on its first call.
    """
    if uri in _reaped:
        return
    _reaped.add(uri)
    try:
        experiments = [e.experiment_id for e in client.search_experiments()]
        if not experiments:
            return
        host = socket.gethostname().replace("'", "")
        runs = client.search_runs(
            experiments,
            filter_string=f"attributes.status = 'RUNNING' and tags.`air_magic.host` = '{host}'",
            max_results=ORPHAN_SEARCH_LIMIT,
        )
        for run in runs:
            if not caller_alive(run.data.tags.get("air_magic.caller", "")):
                # The rows its ranks wrote and it had not stored yet: into the run, before it ends.
                kept, outcome = metric_writer.import_left_behind(client, run.info.run_id)
                imported = f"; {kept} metric row(s) it left on disk were imported" if kept else ""
                if outcome is not None:  # the call ended, but the store refused its run's end then
                    client.set_tag(run.info.run_id, "air_magic.outcome", outcome)
                    client.set_terminated(run.info.run_id, terminal_status(outcome))
                    continue
                client.set_tag(run.info.run_id, "air_magic.outcome", "caller ended")
                client.set_tag(
                    run.info.run_id,
                    "air_magic.error",
                    "the process that made this call ended before the call did (kernel restart or kill)"
                    + imported,
                )
                client.set_terminated(run.info.run_id, "KILLED")
    except Exception as exc:  # noqa: BLE001 - housekeeping must never stop a call
        _warn(f"could not check for runs left RUNNING by ended processes: {metric_rows.short_error(exc)}")


_STATUS = {"succeeded": "FINISHED", "interrupted": "KILLED", "untracked": "KILLED"}


def terminal_status(outcome: str) -> str:
    """The MLflow status a call's outcome ends its run with (failed and timeout: FAILED)."""
    return _STATUS.get(outcome, "FAILED")


def caller_alive(caller: str) -> bool:
    """The process a :func:`caller_id` names still runs (same pid and start, not a zombie)."""
    import psutil

    pid_text, _, started = caller.partition(":")
    try:
        proc = psutil.Process(int(pid_text))
        return f"{proc.create_time():.3f}" == started and proc.status() != psutil.STATUS_ZOMBIE
    except (ValueError, psutil.Error):
        return False


def _warn(message: str) -> None:
    with contextlib.suppress(Exception):
        warnings.warn(f"air_magic: {message}", RuntimeWarning, stacklevel=3)
