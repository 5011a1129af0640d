"""Resuming an MLflow run: a call recorded in an existing run rather than a new one.

``tracking/run.py`` asks :func:`run_to_resume` which run (``mlflow_run_id=``, else
``MLFLOW_RUN_ID`` set in the caller without an active run, said in one line),
and :func:`reopen` checks it and marks it RUNNING again for this call. The
call's outcome then ends it, FINISHED, FAILED or KILLED, as a new run would be.

What a resumed run keeps apart, call by call (the Nth air_magic call on it,
counted in its ``air_magic.calls`` tag): logs in ``logs/call-N/`` and the source
in ``source/call-N/``; a launch parameter that differs from the value already
recorded goes in as ``call-N.<name>`` (MLflow never changes a parameter).
Metrics go on: the ranks choose their steps, and system metrics continue from
the run's last ``system/`` step. Tags (outcome, error, failed rank) say how the
latest call ended.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

from air_magic.errors import ConfigurationError
from air_magic.tracking import store


@dataclass(frozen=True)
class Reopened:
    """The run a call is recorded in: an existing one it continues, or (``existing=False``) its own."""

    run_id: str
    experiment_id: str
    call_number: int  # this call is the run's Nth air_magic call
    params: dict[str, str] = field(default_factory=dict)  # what the run already records
    existing: bool = True


def run_to_resume(explicit: str | None, active: Any) -> str | None:
    """The run to continue: ``mlflow_run_id=``, else ``MLFLOW_RUN_ID`` of this process (said in one line)
    when the notebook has no active run (with one, the call's run is its child, as always)."""
    if explicit is not None:
        return explicit
    from_env = os.environ.get("MLFLOW_RUN_ID", "").strip()
    if not from_env or active is not None:
        return None
    print(
        f"air_magic: MLFLOW_RUN_ID is set in this process, so this call is recorded in run {from_env} "
        "(resumed, not a new run); unset it for a new run per call",
        file=sys.stderr,
        flush=True,
    )
    return from_env


def reopen(client: Any, uri: str, run_id: str, experiment: str | None) -> Reopened:
    """Check that ``run_id`` can take this call, and mark it RUNNING for it."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        raise ConfigurationError(
            f"mlflow_run_id={run_id!r}: no such MLflow run in {uri} ({str(exc).splitlines()[0]}); "
            "nothing was launched"
        ) from None
    info, tags = run.info, run.data.tags
    if info.lifecycle_stage == "deleted":
        raise ConfigurationError(
            f"mlflow_run_id={run_id!r}: that MLflow run was deleted; nothing was launched"
        )
    if experiment is not None:
        named = client.get_experiment_by_name(experiment)
        if named is None or named.experiment_id != info.experiment_id:
            raise ConfigurationError(
                f"mlflow_run_id={run_id!r} is a run of experiment {info.experiment_id}, not of "
                f"experiment={experiment!r}: leave out one of the two; nothing was launched"
            )
    if info.status == "RUNNING":
        caller, host = tags.get("air_magic.caller"), tags.get("air_magic.host")
        if caller is None or host != socket.gethostname() or store.caller_alive(caller):
            # Not an air_magic call of this machine that died (those are the ones we may take
            # over): the notebook's own active run, another tool's, another machine's, a live call.
            raise ConfigurationError(
                f"mlflow_run_id={run_id!r} is RUNNING: something else is recording into it (a live call, "
                "another machine, or an active run of MLflow's own); end it first, or record this "
                "call elsewhere; nothing was launched"
            )
    try:
        earlier = int(tags.get("air_magic.calls", "1" if "air_magic.kind" in tags else "0"))
    except ValueError:
        earlier = 1
    client.update_run(run_id, status="RUNNING")
    for stale in ("air_magic.error", "air_magic.failed_rank"):  # the last call's: this one says its own
        if stale in tags:
            client.delete_tag(run_id, stale)
    return Reopened(run_id, info.experiment_id, earlier + 1, dict(run.data.params))
