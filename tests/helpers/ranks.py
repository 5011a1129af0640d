"""One call on real ranks from a test, and what tests check around it (starter, MLflow status)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers.paths import script


def mlflow_status(info) -> str:
    """The MLflow status of a run's call, read back from the session's embedded store."""
    from mlflow.tracking import MlflowClient

    from air_magic.paths import embedded_mlflow_uri as embedded_uri

    assert info is not None and info.mlflow_run_id, "the call was not tracked"
    return MlflowClient(embedded_uri()).get_run(info.mlflow_run_id).info.status


def ready_starter() -> None:
    """Wait (up to 120 s) until the warm starter has imported torch, as a loaded machine may need.

    A call waits for the starter no longer than its own timeout, and then reports that no rank
    started: right for users, wrong for a test of what ranks do at a 3-second timeout."""
    from air_magic.node import warm

    if warm.enabled():
        assert warm.get_starter(wait_s=120) is not None, "the warm starter did not come up"


def run_ranks(fn, *args, n=2, wait_for_starter=True, **settings):
    """Call ``fn`` on ``n`` ranks; when a launched call fails, its MLflow run must say FAILED."""
    import air_magic

    settings.setdefault("display", "none")
    if wait_for_starter and settings.get("timeout") is not None and settings.get("warm_start", True):
        ready_starter()  # a short timeout tests the ranks, not how long torch takes to import
    before = air_magic.last_run()
    try:
        return air_magic.distributed(num_accelerators=n, **settings)(fn).distributed(*args)
    except Exception:
        after = air_magic.last_run()
        if after is not before and after.mlflow_run_id:
            assert mlflow_status(after) == "FAILED"
        raise


def raise_everywhere_at_once(barrier_dir):
    """A rank function: every rank raises once all have reached the barrier folder."""
    import os
    import time

    rank = int(os.environ["RANK"])
    open(os.path.join(barrier_dir, str(rank)), "w").close()
    while len(os.listdir(barrier_dir)) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.001)
    raise ValueError(f"rank {rank} failed")


def interrupt_tracked_caller(folder: Path, metrics_per_rank: int = 0) -> tuple[str, str]:
    """Run tests/helpers/tracked_caller.py (experiment 'interrupted'), SIGINT it once both ranks
    have logged ``metrics_per_rank`` metrics and are asleep; return its stdout and stderr."""
    ready = folder / "ready"
    ready.mkdir()
    proc = subprocess.Popen(
        [sys.executable, script("tracked_caller.py"), str(ready), str(metrics_per_rank)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while len(os.listdir(ready)) < 2:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    return proc.communicate(timeout=60)
