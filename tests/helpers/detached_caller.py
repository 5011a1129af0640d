"""A caller that starts a detached run, prints its id, then waits to be killed (a kernel that dies).

Usage: python detached_caller.py GATE. Each rank prints a line, waits until the
file GATE exists, prints another and returns ten times its rank.
"""

import sys
import time

import air_magic


@air_magic.distributed(num_accelerators=2, display="none", detach=True)
def waits(gate):
    import os
    import time

    rank = int(os.environ["RANK"])
    print(f"rank {rank} before the gate", flush=True)
    while not os.path.exists(gate):
        time.sleep(0.02)
    print(f"rank {rank} after the gate", flush=True)
    return rank * 10


handle = waits.distributed_async(sys.argv[1])
print(handle.detached_id, flush=True)
time.sleep(600)
