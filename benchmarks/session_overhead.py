"""Per-cell overhead of a persistent session (SPEC §15), in a real Jupyter kernel with tabs on.

    python benchmarks/session_overhead.py [--ranks 2] [--cells 20] [--rounds 5] [--no-ipyparallel]

One kernel (jupyter_client), the extension loaded, a session of RANKS ranks up,
and the same trivial cell (``x = 1``) timed end to end inside the kernel
(``run_cell_magic``, as a notebook cell runs it: parsing, capture, payload, the
ranks, the tabs built and closed) by three ways, in rounds whose order rotates:

- ``session``: ``%%distributed`` in the session (tabs; tracking off);
- ``warm call``: the same work as a one-off call on warm ranks
  (``fn.distributed()`` with tabs, tracking off: forks of the warm starter);
- ``%%px``: ipyparallel's cell magic on RANKS engines (when installed).

Reports each way's median per cell and a bootstrap 90 % interval of the median
(over every cell of every round), plus the session's median with tracking on
(``session tracked``: a second session, its MLflow run in a temporary store).
The first round is a warm-up and is dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import statistics
import sys
import tempfile
import time

from jupyter_client.manager import start_new_kernel
from stats import median_interval  # benchmarks/stats.py: scripts run as python benchmarks/x.py

SETUP = r"""
import json, os, time, air_magic
ip = get_ipython()
ip.run_line_magic("load_ext", "air_magic")

@air_magic.distributed(num_accelerators={ranks}, tracking=False, display="tabs")
def trivial():
    x = 1

def time_cells(how, n, into=None):
    took = []
    for _ in range(n):
        start = time.perf_counter()
        if how == "session":
            ip.run_cell_magic("distributed", "--display tabs", "x = 1")
        elif how == "warm call":
            trivial.distributed()
        else:
            ip.run_cell_magic("px", "--quiet", "x = 1")
        took.append(time.perf_counter() - start)
    if into:  # a file: %%px leaves this cell's own prints elsewhere
        with open(into, "w") as f:
            json.dump(took, f)
    return took
"""

IPYPARALLEL = r"""
import ipyparallel as ipp
cluster = ipp.Cluster(n={ranks}, log_level=40)
rc = cluster.start_and_connect_sync()
rc.wait_for_engines({ranks}, timeout=120)
rc.activate()
"""


def _run(kc, code: str, timeout: float = 600) -> str:
    """Execute ``code`` in the kernel; what it printed (an error fails the benchmark)."""
    msg_id = kc.execute(code)
    printed: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        try:
            msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise SystemExit(f"the kernel did not finish within {timeout} s: {code[:80]}") from None
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind = msg["msg_type"]
        if kind == "stream" and msg["content"]["name"] == "stdout":
            printed.append(msg["content"]["text"])
        elif kind == "error":
            raise SystemExit("\n".join(msg["content"]["traceback"]))
        elif kind == "status" and msg["content"]["execution_state"] == "idle":
            return "".join(printed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--cells", type=int, default=20, help="cells per way per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-ipyparallel", action="store_true")
    args = parser.parse_args()
    ways = ["session", "warm call"]
    if not args.no_ipyparallel:
        try:
            import ipyparallel  # noqa: F401

            ways.append("%%px")
        except ImportError:
            print("ipyparallel is not installed: %%px is left out (pip install ipyparallel)")
    store = tempfile.mkdtemp(prefix="air_magic-bench-")
    env = {**os.environ, "AIR_MAGIC_MLFLOW_DIR": store, "MLFLOW_TRACKING_URI": ""}
    env.pop("MLFLOW_TRACKING_URI")
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=store)
    try:
        _run(kc, SETUP.format(ranks=args.ranks))
        if "%%px" in ways:
            _run(kc, IPYPARALLEL.format(ranks=args.ranks))
        _run(
            kc,
            f"ip.run_line_magic('distributed', 'session start -n {args.ranks} --no-tracking --display none')",
        )
        took: dict[str, list[float]] = {way: [] for way in ways}
        for round_ in range(args.rounds + 1):
            order = ways[round_ % len(ways) :] + ways[: round_ % len(ways)]
            for way in order:
                into = os.path.join(store, "took.json")
                _run(kc, f"time_cells({way!r}, {args.cells}, {into!r})")
                if round_:  # the first round warms everything up
                    with open(into) as f:
                        took[way] += json.load(f)
        _run(kc, "ip.run_line_magic('distributed', 'session stop')")
        _run(kc, f"ip.run_line_magic('distributed', 'session start -n {args.ranks} --display none')")
        _run(kc, f"time_cells('session', {args.cells})")
        out = _run(kc, f"print(json.dumps(time_cells('session', {args.cells * args.rounds})))")
        took["session tracked"] = json.loads(out.strip().splitlines()[-1])
        _run(kc, "ip.run_line_magic('distributed', 'session stop')")
        if "%%px" in ways:
            _run(kc, "cluster.stop_cluster_sync()")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        # The tracked session's link started the store's UI server (it outlives kernels): stop it.
        import subprocess

        subprocess.run(
            [sys.executable, "-m", "air_magic", "ui", "--stop"], env=env, check=False, capture_output=True
        )
    print(
        f"{time.strftime('%Y-%m-%d')} · {platform.node()} · {os.cpu_count()} CPUs · Python "
        f"{platform.python_version()} · {args.ranks} ranks · {args.cells} cells x {args.rounds} rounds"
    )
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"{'way':<16} {'median ms':>10} {'90% interval':>18} {'p90 ms':>8}")
    for way, values in took.items():
        low, high = median_interval(values)
        p90 = sorted(values)[int(0.9 * len(values)) - 1]
        median = statistics.median(values)
        print(f"{way:<16} {median * 1e3:>10.1f} {low * 1e3:>8.1f}-{high * 1e3:<8.1f} {p90 * 1e3:>8.1f}")


if __name__ == "__main__":
    main()
