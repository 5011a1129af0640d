"""A loopback Ray head with its dashboard, as a user's cluster would have one: started, then stopped
with every process it left. One place for the tests (``tests/ray_cluster/test_ray_jobs.py``) and the
benchmarks (``benchmarks/ray_job_submit.py``).

``ray start --head --block`` runs in a process group of its own; every listener is on 127.0.0.1
(NOTES.md) and the Ray Client server gets a port chosen here (Ray's 10001 by default: two heads
would collide).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import psutil

START_S = 90


@dataclass
class RayHead:
    proc: subprocess.Popen
    address: str  # the dashboard's: what jobs are submitted to (http://127.0.0.1:PORT)
    client: str  # the Ray Client's: ray://127.0.0.1:PORT
    temp: str  # Ray's temp folder (its session folder, logs and sockets)
    env: dict[str, str]  # the environment it started with; its jobs' python3 is this interpreter


def start_head(num_cpus: int) -> RayHead:
    temp = tempfile.mkdtemp(prefix="rh", dir="/tmp")  # short: Ray's socket paths live under it
    bin_dir = os.path.dirname(sys.executable)
    client_port = free_port()
    env = {
        **os.environ,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # every listener on 127.0.0.1 (NOTES.md)
        "RAY_USAGE_STATS_ENABLED": "0",
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),  # the jobs' python3: this one's
    }
    proc = subprocess.Popen(
        [os.path.join(bin_dir, "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         "--port=0", "--include-dashboard=true", "--dashboard-host=127.0.0.1", "--dashboard-port=0",
         "--dashboard-agent-listen-port=0", f"--ray-client-server-port={client_port}",
         "--disable-usage-stats", f"--temp-dir={temp}", f"--num-cpus={num_cpus}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    address = None
    said: list[str] = []
    deadline = time.monotonic() + START_S
    while address is None and time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        said.append(line)
        found = re.search(r"RAY_API_SERVER_ADDRESS='(http://[^']+)'", line)
        address = found.group(1) if found else None
    head = RayHead(proc, address or "", f"ray://127.0.0.1:{client_port}", temp, env)
    if address is None:
        try:
            stop_head(head)
        except AssertionError:
            pass  # what it left matters less than why it did not start
        raise AssertionError("the Ray head did not start:\n" + "".join(said[-30:]))
    return head


def free_port() -> int:
    """A port free now on 127.0.0.1 (Ray cannot be told to leave its client server out or let the
    kernel choose its port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stop_head(head: RayHead) -> None:
    """Stops the head and kills whatever of it is left; raises if a process outlives 30 s of that."""
    # `ray start` alone: it stops its processes in 3 s; SIGTERM to the whole group also reaches the
    # GCS, and the raylet then waits 30 s to drain. The group is killed after, with anything left.
    try:
        head.proc.terminate()
        head.proc.wait(30)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(head.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 30
    while True:
        left = [p for p in psutil.process_iter(["cmdline"]) if head.temp in " ".join(p.info["cmdline"] or ())]
        if not left or time.monotonic() > deadline:
            break
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        time.sleep(0.5)
    subprocess.run(["rm", "-rf", head.temp], check=False)
    assert not left, f"the Ray head left processes: {left}"
