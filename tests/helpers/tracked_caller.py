"""A tracked call in a script, for the interrupt test: ranks write a file when ready, then sleep."""

import os
import sys

from air_magic import distributed


@distributed(num_accelerators=2, display="none", experiment="interrupted")
def sleeper(ready_dir):
    import os
    import time

    open(os.path.join(ready_dir, f"rank-{os.environ['RANK']}"), "w").close()
    time.sleep(600)


if __name__ == "__main__":
    try:
        sleeper.distributed(sys.argv[1])
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        os._exit(130)
