"""A remote (http/https) tracking server: how long a call waits for it, and whether it answers.

An unreachable server costs a call at most :data:`REMOTE_CHECK_S` (or the
call's ``timeout`` if shorter): one request to its ``/health`` without retries,
then one loud line, and the call runs untracked. Why not fail the call: the
ranks' work matters more than its record, and their logs are kept on disk
either way; why not MLflow's own retries: 7 retries of up to 120 s each, twice,
held every call for minutes and ignored ``timeout=``. A server that answers is
given :data:`REMOTE_SETUP_S` to create the run and :data:`REMOTE_END_S` to
confirm its end; past that the call goes on and the work finishes in the
background. MLflow's own settings (``MLFLOW_HTTP_REQUEST_*``) are left as they
are.

A local store (a file or a database) has no network to wait on: a call waits
for it until it is done (an interrupt still stops the wait).
"""

from __future__ import annotations

import contextlib
import sys
import warnings

from air_magic import paths
from air_magic.protocol import env_names, wire

# How long a remote server gets to answer a health check, to create the call's run (both also
# bounded by the call's timeout), and to confirm the run's end. Why these: a server that is up
# answers /health in a round trip or two, TLS and a distant region included (5 s is far above
# that); creating and ending a run take several requests each (experiment, run, parameters,
# source; tags, logs, status), queued behind other clients on a busy server. Past these a user
# is better served by a call that runs untracked than by one that waits.
REMOTE_CHECK_S = 5.0
REMOTE_SETUP_S = 30.0
REMOTE_END_S = 30.0
# Where the ranks of an untracked call send their own MLflow calls: a throwaway store of each
# rank's own (protocol/wire.py says why). What the ranks log there is not kept.
UNTRACKED_RANK_URI = wire.UNTRACKED_MLFLOW_URI


def is_remote(uri: str) -> bool:
    return uri.split(":", 1)[0].lower() in ("http", "https")


def setup_wait_s(uri: str, timeout: float | None) -> float | None:
    """How long the call waits for its run: a remote server, bounded; a local store, until it is made."""
    if not is_remote(uri):
        return None  # a local file or database: no network to wait on (an interrupt still stops the wait)
    return REMOTE_SETUP_S if timeout is None else min(REMOTE_SETUP_S, timeout)


def check_s(setup_wait: float | None) -> float:
    """How long the health check may take: :data:`REMOTE_CHECK_S`, or less when the call has less."""
    return REMOTE_CHECK_S if setup_wait is None else min(REMOTE_CHECK_S, setup_wait)


def unreachable(uri: str, seconds: float) -> str | None:
    """Why the tracking server at ``uri`` cannot take this call's run, or None when it answers.

    One request to its ``/health``, with MLflow's own credentials and TLS settings, no retry,
    ``seconds`` to connect and as much to answer: a refused connection fails at once and a
    server that accepts but never answers after ``seconds``, where MLflow's defaults (7
    retries, 120 s each) would hold every call for minutes. Any HTTP answer below 500 counts as
    up (a 404 may be a server under a path prefix; what is not MLflow fails the run's creation,
    and the call runs untracked then too); a 5xx, which MLflow would retry for minutes, does not.

    ``http_request`` and ``get_default_host_creds`` are not MLflow's public API (docs/
    architecture.md, "Private MLflow APIs we depend on"): when an MLflow release moves or
    changes them, the check is skipped with a warning and MLflow's own retries apply.
    """
    try:
        from mlflow.utils.credentials import get_default_host_creds
        from mlflow.utils.rest_utils import http_request
    except ImportError as exc:
        _warn(f"cannot check {uri} quickly before the call ({exc}); MLflow's own retries apply")
        return None
    try:
        answer = http_request(
            get_default_host_creds(uri),
            "/health",
            "GET",
            max_retries=0,
            backoff_factor=0,
            timeout=seconds,
            raise_on_status=False,
        )
    except TypeError as exc:  # the signature changed in this MLflow: no verdict on the server
        _warn(f"cannot check {uri} quickly before the call ({exc}); MLflow's own retries apply")
        return None
    except Exception as exc:  # noqa: BLE001 - whatever the cause, the server cannot be used now
        text = str(exc)
        if "refused" in text.lower():
            return "refused the connection"
        if "timed out" in text.lower() or "timeout" in text.lower():
            return f"did not answer within {seconds:g} s"
        # One line, cut: MLflow's errors can carry a whole HTML error page or a long traceback.
        first_line = (text.splitlines() or [type(exc).__name__])[0]  # an exception may have no text
        return f"could not be reached ({first_line[:300]})"
    status = getattr(answer, "status_code", None)
    if isinstance(status, int) and status >= 500:  # a proxy that cannot reach it, a server down
        return f"answered HTTP {status} to /health"  # MLflow would retry such answers for minutes
    return None


def say_untracked(uri: str, why: str, log_root: str | None) -> None:
    """One loud line: the call goes on, but MLflow will not have it; where the ranks' own MLflow
    calls go instead (:data:`UNTRACKED_RANK_URI`)."""
    if uri == paths.embedded_mlflow_uri():
        subject = f"the embedded MLflow store {paths.embedded_mlflow_dir()}"
        why = f"{why} (set {env_names.MLFLOW_DIR} to a folder you can write, or pass tracking=False)"
    elif is_remote(uri):
        subject = f"the MLflow tracking server {uri}"
    else:
        subject = f"the MLflow tracking store {uri or '(unknown)'}"
    print(
        f"air_magic: WARNING: {subject} {why}: this call runs UNTRACKED "
        f"(its rank logs are kept under {log_root or paths.default_log_root()}; the ranks' own "
        "MLflow calls go to a throwaway store in each rank's call folder and are not kept)",
        file=sys.stderr,
        flush=True,
    )


def _warn(message: str) -> None:
    with contextlib.suppress(Exception):
        warnings.warn(f"air_magic: {message}", RuntimeWarning, stacklevel=3)
