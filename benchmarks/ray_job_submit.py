"""How soon a detached run on Ray is accepted and prints (issue 35): ``air-magic run --detach`` on a Ray head.

    python benchmarks/ray_job_submit.py [--runs 3]

Starts a loopback Ray head with its dashboard (``tests/helpers/ray_head.py``, the tests' own), then, per
run, times ``air-magic run --cluster ray=http://... --detach -n 2 hello.py`` from its start to its
return (the job accepted) and to the first rank's line, seen by ``air-magic attach --json`` in a
process with no local state. Stops the head at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from helpers.ray_head import start_head, stop_head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    bin_dir = os.path.dirname(sys.executable)
    started = time.monotonic()
    head = start_head(num_cpus=4)
    address, env = head.address, head.env
    print(json.dumps({"head_start_s": round(time.monotonic() - started, 1)}), flush=True)
    project = tempfile.mkdtemp(prefix="ray-job-")
    with open(os.path.join(project, "hello.py"), "w") as f:
        f.write("import os\nprint('rank', os.environ['RANK'], 'hello', flush=True)\n")
    follower = {**env, "HOME": tempfile.mkdtemp(), "RAY_ADDRESS": address}
    follower["XDG_STATE_HOME"] = follower["HOME"]
    try:
        for _ in range(args.runs):
            t0 = time.monotonic()
            done = subprocess.run(
                [os.path.join(bin_dir, "air-magic"), "run", "--no-tracking", "--cluster", f"ray={address}",
                 "--detach", "-n", "2", "hello.py"],
                cwd=project, env=env, capture_output=True, text=True, check=True,
            )  # fmt: skip
            returned = time.monotonic() - t0
            run_id = re.search(r"detached run (\S+) started", done.stdout).group(1)  # type: ignore[union-attr]
            attach = subprocess.Popen(
                [os.path.join(bin_dir, "air-magic"), "attach", "--json", run_id],
                env=follower, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )  # fmt: skip
            first = None
            for line in attach.stdout:
                if first is None and '"event": "line"' in line:
                    first = time.monotonic() - t0  # as the attach printed it: what a user sees
            attach.wait()
            ended = time.monotonic() - t0
            row = {
                "returned_s": round(returned, 2),
                "first_line_s": round(first or -1, 2),
                "ended_s": round(ended, 2),
            }
            print(json.dumps(row), flush=True)
    finally:
        stop_head(head)


if __name__ == "__main__":
    main()
