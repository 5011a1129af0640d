"""Tracked calls interrupted by a real SIGINT at chosen moments, then one call that must work.

Usage: ``early_interrupt_caller.py DELAY [DELAY ...]``. Each delay (seconds) is one call that this
process interrupts with ``SIGINT`` that long after the call began (``never``: a call left to finish,
to import mlflow before the interrupted ones); the first call of the process is
the one that imports mlflow, so a short first delay lands in that import. Then one more call, not
interrupted. The last line printed is JSON: each call's outcome, what the process was doing
when each SIGINT was sent, the last call's results and run, and the runs of the store still
RUNNING (after up to 15 s for runs being ended).
"""

import json
import os
import signal
import sys
import threading
import time

import air_magic
from air_magic import distributed, paths


@distributed(num_accelerators=2, display="none", experiment="early-interrupt", warm_start=False)
def rank_number():
    import os

    return int(os.environ["RANK"])


def call_interrupted_after(delay: str, landed: list[str]) -> str:
    if delay == "never":
        rank_number.distributed()
        return "finished"
    timer = threading.Timer(float(delay), interrupt, (landed,))
    try:
        try:
            timer.start()
            rank_number.distributed()
            outcome = "finished"
        finally:
            timer.join()  # a SIGINT that comes after the call lands here, not in the next call
    except KeyboardInterrupt:
        outcome = "interrupted"
    return outcome


def interrupt(landed: list[str]) -> None:
    """SIGINT this process, noting whether mlflow's import was under way at that moment."""
    package = sys.modules.get("mlflow")
    if package is None:
        landed.append("before mlflow was imported")
    elif getattr(package.__spec__, "_initializing", False):  # set by importlib while the module runs
        landed.append("while mlflow was being imported")
    else:
        landed.append("after mlflow was imported")
    os.kill(os.getpid(), signal.SIGINT)


def runs_still_running() -> list[str]:
    try:
        from mlflow.tracking import MlflowClient
    except Exception as exc:  # noqa: BLE001 - a broken mlflow import is what the test looks for
        return [f"could not read the store: {type(exc).__name__}: {exc}"]

    client = MlflowClient(paths.embedded_mlflow_uri())
    experiments = [e.experiment_id for e in client.search_experiments()]
    deadline = time.monotonic() + 15
    while True:
        running = [r.info.run_id for r in client.search_runs(experiments) if r.info.status == "RUNNING"]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.2)


if __name__ == "__main__":
    # As in a notebook or a script run from a terminal, even when started from a background job
    # (which inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    landed: list[str] = []
    outcomes = [call_interrupted_after(delay, landed) for delay in sys.argv[1:]]
    try:
        results, error = rank_number.distributed(), None
    except Exception as exc:  # noqa: BLE001 - reported to the test, which shows it
        results, error = None, f"{type(exc).__name__}: {exc}"
    last = air_magic.last_run()
    print(
        json.dumps(
            {
                "outcomes": outcomes,
                "landed": landed,
                "results": results,
                "error": error,
                "last_run": last.mlflow_run_id if last else None,
                "running": runs_still_running(),
            }
        ),
        flush=True,
    )
