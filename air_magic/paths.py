"""Every folder and file name of air_magic's own on disk: the one place they are spelled.

Logs and the embedded MLflow store live under ``$XDG_STATE_HOME/air_magic``
(``~/.local/state/air_magic``); a call's private folders live in the temp folder,
named after their owner (``private_files.private_tempdir``). Standard library only.
"""

from __future__ import annotations

import os

from air_magic.protocol import env_names, wire

APP = "air_magic"
TEMP_PREFIX = f"{APP}-"  # private temp folders: air_magic-<kind>-<random>.<owner>
METRICS_KIND = "metrics"  # a call's metric folder: air_magic-metrics-<random>.<owner>
METRICS_RUN_FILE = "run-id"  # in a metric folder: the MLflow run its rows belong to (an import after a kill)
# In a metric folder whose run's end the store refused: how the call ended (the run gets it when stored).
METRICS_OUTCOME_FILE = "outcome"
STARTER_LOG = "starter.log"  # the warm starter's own output, beside the call folders
MLFLOW_DB = "mlflow.db"
MLFLOW_DB_LOCK = "mlflow.db.lock"  # flock: one process at a time opens (and migrates) the store
MLFLOW_ARTIFACTS = "artifacts"
MLFLOW_UI_LOG = "ui.log"  # the shared UI server's output (tracking/ui_server.py), in its folder
MLFLOW_UI_STATE = "ui-{space}.json"  # the store's UI server of this boot and pid namespace (tracking/ui.py)
MLFLOW_UI_LOCK = "ui.lock"  # flock: one process at a time reads, starts or replaces that server
MLFLOW_UI_DIR = "mlflow-ui"  # state_dir(MLFLOW_UI_DIR, key): the UI folder of a store other than ours
MLFLOW_SERVED_ARTIFACTS = "served-artifacts"
DETACHED_DIR = "detached"  # state_dir(DETACHED_DIR): one folder per detached run (calls/detached.py)
DETACHED_REQUEST = "request.pkl"  # in it: the call, for its supervisor (deleted once read)
DETACHED_STATE = "state.json"  # what the run is and how it stands
DETACHED_EVENTS = "events.jsonl"  # every event of the call (protocol/event_log.py)
DETACHED_RESULT = "result.pkl"  # every rank's value, or the error
DETACHED_RESULT_TEXT = "result.json"  # a Ray job's, as text: its followers unpickle nothing
SUPERVISOR_LOG = "supervisor.log"  # the supervisor's own output
DETACHED_LISTENING = "listening"  # an empty mark: the supervisor's stop signal handler is in place
DETACHED_CANCEL = "cancel"  # an empty mark: cancel() was asked (before the handler was there, say)
RAY_DIR = "ray"  # state_dir(RAY_DIR): the local Ray cluster's token and logs
RAY_TOKEN = "auth_token"  # its token file (0600)


def state_dir(*parts: str) -> str:
    """``$XDG_STATE_HOME/air_magic/...`` (``~/.local/state/air_magic/...``)."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, APP, *parts)


def cache_dir(*parts: str) -> str:
    """``$XDG_CACHE_HOME/air_magic/...`` (``~/.cache/air_magic/...``): what may be deleted at any time."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, APP, *parts)


DATA_CACHE = "data"  # cache_dir(DATA_CACHE): remote files that air_magic.data downloaded


def default_log_root() -> str:
    """Where each call's log folder is made unless ``log_dir=`` says otherwise."""
    return os.environ.get(env_names.LOG_ROOT) or state_dir("runs")


def embedded_mlflow_dir() -> str:
    """The embedded MLflow store's folder (``AIR_MAGIC_MLFLOW_DIR`` moves it)."""
    return os.environ.get(env_names.MLFLOW_DIR) or state_dir("mlflow")


def embedded_mlflow_uri() -> str:
    return "sqlite:///" + os.path.join(embedded_mlflow_dir(), MLFLOW_DB)


STACKS_FILE = "stacks.txt"  # in a call's log folder: every stack dump taken (outcome/stacks.py)
RUN_SUMMARY = "run.json"  # in a call's log folder: what it was and how it ended (air-magic runs)


def run_summary(log_dir: str) -> str:
    return os.path.join(log_dir, RUN_SUMMARY)


def rank_log(log_dir: str, rank: int) -> str:
    """A rank's log in the call's log folder: stdout and stderr, whole lines."""
    return wire.rank_log_path(log_dir, rank)
