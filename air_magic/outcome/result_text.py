"""A call's result as JSON, for followers that must not unpickle what they read (a Ray job's).

A detached run on a Ray cluster (``calls/ray_jobs.py``) is followed over the cluster's
dashboard, from machines that share the cluster with everyone who may submit jobs to it: a
follower there unpickles nothing. The job's supervisor writes ``result.json`` with
:func:`to_json`; a follower rebuilds a :class:`RunResult` with :func:`from_json`: the
outcome, each rank's value when it is plain data (JSON), and an error as text -- the rank,
its exception's type and message and its own traceback -- raised as a
:class:`RankFailedError` (the exit status and the printed traceback are a local attach's).
The supervisor's exit status says the outcome too (:data:`SUPERVISOR_EXIT`): Ray reports it
with the job, so a listing needs no file.
"""

from __future__ import annotations

import json
from typing import Any

from air_magic.errors import DistributedTimeoutError, LaunchError, RankFailedError, RemoteTraceback
from air_magic.launch.request import RunResult
from air_magic.protocol.events import Outcome

# The supervisor's exit status for each outcome (calls/supervisor.py), and what a job's says back.
SUPERVISOR_EXIT = {Outcome.SUCCEEDED: 0, Outcome.FAILED: 3, Outcome.TIMEOUT: 4, Outcome.INTERRUPTED: 5}
EXIT_BEFORE_THE_CALL = 6  # the supervisor failed before the call ran (its result says why); 1 is Python's
RUN_STATUS_OF_EXIT = {
    0: "succeeded",
    3: "failed",
    4: "timeout",
    5: "cancelled",
    EXIT_BEFORE_THE_CALL: "failed",
}


def to_json(result: RunResult) -> bytes:
    """``result`` as JSON: values only if they are plain data, the error as text."""
    out: dict[str, Any] = {
        "outcome": str(result.outcome.value),
        "run_id": result.call_id,  # the key unchanged (a follower reads this file)
        "log_dir": result.log_dir,
    }
    if result.error is None:
        try:
            out["values"] = json.loads(json.dumps(result.values, allow_nan=False))
        except (TypeError, ValueError) as exc:
            out["values_unsent"] = f"the ranks' values are not plain data (JSON): {exc}"
    else:
        error = result.error
        cause = error.__cause__ if isinstance(error.__cause__, RemoteTraceback) else None
        out["error"] = {
            "type": f"{type(error).__module__}.{type(error).__qualname__}",
            "message": str(error),
            "rank": getattr(error, "air_magic_rank", getattr(error, "rank", None)),
            "exit_code": getattr(error, "exit_code", None),
            "remote_traceback": cause.text if cause is not None else getattr(error, "remote_traceback", None),
        }
    return json.dumps(out).encode()


def from_json(data: bytes) -> RunResult:
    """The :class:`RunResult` a follower raises or returns, from :func:`to_json`'s text."""
    fields = json.loads(data)
    outcome = Outcome(fields["outcome"])
    call_id, log_dir = fields.get("run_id", ""), fields.get("log_dir", "")
    said = fields.get("error")
    if said is None:
        if "values_unsent" in fields:
            error: BaseException = LaunchError(
                f"the run succeeded, but {fields['values_unsent']}; a follower of a Ray job unpickles "
                "nothing it reads from the cluster. Return plain data (or write the results to storage)."
            )
            return RunResult(call_id, log_dir, Outcome.FAILED, error=error)
        return RunResult(call_id, log_dir, outcome, values=fields.get("values"))
    message = said.get("message", "")
    if outcome is Outcome.INTERRUPTED:
        error = LaunchError(message)
    elif outcome is Outcome.TIMEOUT:
        error = DistributedTimeoutError(message, still_running=[], log_dir=log_dir)
    else:
        rank = said.get("rank")
        text = said.get("remote_traceback")
        kind = str(said.get("type", "")).rsplit(".", 1)[-1]
        error = RankFailedError(
            f"{kind}: {message}" if kind and rank is not None else message,
            rank=rank if isinstance(rank, int) else -1,
            exit_code=said.get("exit_code"),
            log_dir=log_dir,
            remote_traceback=text,
        )
        if text:
            error.__cause__ = RemoteTraceback(text)
    return RunResult(call_id, log_dir, outcome, error=error)
