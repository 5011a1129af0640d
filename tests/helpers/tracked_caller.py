"""A tracked call in a script, for the interrupt tests: ranks log metrics, write a file when ready, sleep."""

import os
import signal
import sys

from air_magic import distributed


@distributed(num_accelerators=2, display="none", experiment="interrupted")
def sleeper(ready_dir, steps):
    import os
    import time

    if steps:
        import mlflow

        for step in range(steps):
            mlflow.log_metric(f"rank{os.environ['RANK']}", step, step=step)

    open(os.path.join(ready_dir, f"rank-{os.environ['RANK']}"), "w").close()
    time.sleep(600)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
    try:
        sleeper.distributed(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        os._exit(130)
