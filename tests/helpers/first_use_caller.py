"""One of several processes making their first tracked call at the same moment, on one fresh store.

Usage: ``first_use_caller.py BARRIER_DIR COUNT``. The process imports mlflow first (so that the
processes meet at the barrier ready to open the store), waits until COUNT processes have written
their file into BARRIER_DIR, then makes one tracked call and prints its results and MLflow run id.
"""

import json
import os
import sys
import time

import mlflow  # noqa: F401 - imported before the barrier: every process opens the store at once

import air_magic
from air_magic import distributed


@distributed(num_accelerators=1, display="none", experiment="first-use", warm_start=False)
def answer():
    return 42


if __name__ == "__main__":
    barrier, count = sys.argv[1], int(sys.argv[2])
    open(os.path.join(barrier, str(os.getpid())), "w").close()
    while len(os.listdir(barrier)) < count:
        time.sleep(0.001)
    results = answer.distributed()
    print(json.dumps({"results": results, "run": air_magic.last_run().mlflow_run_id}), flush=True)
