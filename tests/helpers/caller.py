"""A caller script for tests that interrupt or kill the caller itself.

Usage: python caller.py DIR [--warm]. Each rank starts a child (like a DataLoader
worker), writes "<rank pid> <child pid>" to DIR/rank-<N>.pid, and sleeps.
The script prints what happened to the call on stdout.
"""

import signal
import sys

from air_magic import distributed

# Like an interactive script: a test run started in the background inherits SIGINT ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)


@distributed(num_accelerators=2, display="none")
def sleeper(out_dir):
    import os
    import subprocess
    import time

    child = subprocess.Popen(["sleep", "600"])
    path = os.path.join(out_dir, f"rank-{os.environ['RANK']}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.replace(path + ".tmp", path)
    time.sleep(600)


if __name__ == "__main__":
    if "--warm" in sys.argv:  # the ranks below are forked by the warm starter
        from air_magic.node import warm

        warm.get_starter(wait_s=120)
        assert warm.get_starter() is not None, "the warm starter did not come up"
    try:
        sleeper.distributed(sys.argv[1])
    except KeyboardInterrupt:
        print("caller: KeyboardInterrupt", flush=True)
        sys.exit(130)
