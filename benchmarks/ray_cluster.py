"""air_magic on a Ray cluster against Ray Train's TorchTrainer: the same trivial job, same cluster, same run.

    python benchmarks/ray_cluster.py [--pairs 5] [--lines 200] [--no-train] [--no-faults] [--hide-gpus]

The cluster is a real 2-node Ray cluster on this machine (``ray.cluster_utils.Cluster``,
every listener on 127.0.0.1, one fake GPU per node, so 2 ranks span both nodes;
the ranks run gloo on the CPU). Measured, in one process:

- **first call**: the first ``cluster="ray"`` call after ``ray_init`` (placement group,
  one agent per node, the agents' warm starters import torch);
- **warm call**: later calls, interleaved with TorchTrainer runs (A, B, A, B...);
- **TorchTrainer**: ``ray.train.torch.TorchTrainer`` on the same job (2 workers);
- **output delivery**: a rank stamps lines with ``time.time()``; the caller's
  consumer takes the time each arrives;
- **faults**: from a rank's exception / SIGKILL / ``remove_node`` / SIGKILL of a
  worker node's raylet to the caller's error (and, for the raylet, to its ranks' death).

Prints a markdown table with medians and the samples; docs/benchmarks.md keeps the results.
"""

from __future__ import annotations

import argparse
import inspect
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only (before importing Ray)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from trivial_job import trivial  # noqa: E402

from air_magic.calls.call import run_call  # noqa: E402
from air_magic.launch.settings import make_settings  # noqa: E402
from air_magic.protocol.events import RankOutput  # noqa: E402

HIDE_GPUS = False


def stamped_lines(n: int) -> int:
    for i in range(n):
        print(f"{time.time():.6f} {i}", flush=True)
        time.sleep(0.002)
    return n


def raises_after(ready_dir: str) -> None:
    open(os.path.join(ready_dir, os.environ["RANK"]), "w").close()
    if os.environ["RANK"] == "1":
        time.sleep(0.5)
        print(f"RAISED {time.time():.6f}", flush=True)
        raise RuntimeError("boom")
    time.sleep(60)


def killed_after(ready_dir: str) -> None:
    open(os.path.join(ready_dir, os.environ["RANK"]), "w").close()
    if os.environ["RANK"] == "1":
        time.sleep(0.5)
        print(f"KILLED {time.time():.6f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def sleeps(ready_dir: str) -> None:
    open(os.path.join(ready_dir, os.environ["RANK"]), "w").close()
    time.sleep(120)


class Arrivals:
    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []

    def handle(self, event: object) -> None:
        if isinstance(event, RankOutput):
            now = time.time()
            for line in event.text.splitlines():
                self.lines.append((now, line))


class Recording:
    def __init__(self, inner, consumer):
        self.inner, self.consumer, self.name = inner, consumer, inner.name

    def prepare(self, settings):
        return self.inner.prepare(settings)

    def run(self, request, bus):
        bus.add(self.consumer)
        return self.inner.run(request, bus)

    def stop(self) -> None:
        self.inner.stop()


def call(fn, *args, n=2, consumer=None, **settings):
    from air_magic.backends.ray.backend import RayBackend

    if HIDE_GPUS:  # the ranks are CPU ranks with gloo even where the machine has a real GPU
        settings["env"] = {"CUDA_VISIBLE_DEVICES": ""}
    made = make_settings(num_accelerators=n, cluster="ray", display="none", tracking=False, **settings)
    backend = RayBackend()
    if consumer is not None:
        backend = Recording(backend, consumer)
    return run_call(fn.__name__, fn, inspect.signature(fn).bind(*args), made, backend=backend)


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def train_once(storage: str) -> float:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def loop(config):  # the same job: the process group is Ray Train's
        import torch
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t)

    trainer = TorchTrainer(
        loop,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=storage, name=f"bench-{time.time_ns()}"),
    )
    return timed(trainer.fit)


def fault_latency(fn, marker: str, ready: str) -> float:
    arrivals = Arrivals()
    result = call(fn, ready, consumer=arrivals)
    ended = time.time()
    assert result.outcome == "failed", result.outcome
    stamp = next(float(line.split()[1]) for _, line in arrivals.lines if line.startswith(marker))
    return ended - stamp


def node_fault(cluster, kind: str) -> tuple[float, float | None]:
    """remove_node or SIGKILL of the raylet of a worker node: (time to the caller's error, to rank death)."""
    import psutil

    from air_magic.backends.ray import placement
    from air_magic.protocol.events import RankStarted

    ready = tempfile.mkdtemp()
    box: dict[str, float] = {}
    pids: dict[int, int] = {}

    class Pids:
        def handle(self, event):
            if isinstance(event, RankStarted):
                pids[event.rank] = event.pid

    def run() -> None:
        call(sleeps, ready, consumer=Pids())
        box["ended"] = time.time()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    while len(os.listdir(ready)) < 2:
        time.sleep(0.01)
    # A rank on a worker node (removing the head would end the driver); bundles land where Ray puts them.
    by_id = {n.node_id: n for n in cluster.list_all_nodes()}
    nodes = [by_id[d["node_id"]] for d in placement.current().nodes]
    rank = next(i for i, n in enumerate(nodes) if n is not cluster.head_node)
    node = nodes[rank]
    started = time.time()
    died = None
    if kind == "remove":
        cluster.remove_node(node, allow_graceful=False)
        died = time.time() - started  # remove_node returns once the node's processes are killed
    else:
        node.all_processes["raylet"][0].process.send_signal(signal.SIGKILL)
        while True:
            try:
                alive = psutil.Process(pids[rank]).status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                alive = False
            if not alive:
                died = time.time() - started
                break
            time.sleep(0.01)
    thread.join(120)
    if kind != "remove":
        cluster.remove_node(node, allow_graceful=False)
    placement.release_all()
    cluster.add_node(**cluster.node_args)
    cluster.wait_for_nodes()
    return box["ended"] - started, died


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--no-train", action="store_true")
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument("--hide-gpus", action="store_true", help="on a GPU machine: CPU ranks (gloo)")
    args = parser.parse_args()
    global HIDE_GPUS
    HIDE_GPUS = args.hide_gpus

    import ray
    from ray.cluster_utils import Cluster

    import air_magic

    node = {"num_cpus": 2, "num_gpus": 1, "node_ip_address": "127.0.0.1"}
    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    cluster.add_node(**node)
    cluster.wait_for_nodes()
    cluster.node_args = node
    os.environ["RAY_ADDRESS"] = cluster.address
    air_magic.ray_init()
    print(f"cluster up in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    rows: list[tuple[str, list[float]]] = []
    rows.append(("first call after ray_init (air_magic)", [timed(lambda: call(trivial).unwrap())]))
    warm: list[float] = []
    train: list[float] = []
    storage = tempfile.mkdtemp()
    for i in range(args.pairs):
        # Interleaved, alternating which goes first.
        order = ["air", "train"] if i % 2 == 0 else ["train", "air"]
        for who in order:
            if who == "air":
                warm.append(timed(lambda: call(trivial).unwrap()))
            elif not args.no_train:
                # Our agents hold the (fake) GPUs and no CPU: Ray Train's CPU workers fit beside them.
                train.append(train_once(storage))
    rows.append(("warm call (air_magic), interleaved with TorchTrainer", warm))
    if train:
        rows.append(("TorchTrainer.fit (Ray Train)", train))
    steady = [timed(lambda: call(trivial).unwrap()) for _ in range(args.pairs)]
    rows.append(("warm call (air_magic), back to back", steady))

    arrivals = Arrivals()
    call(stamped_lines, args.lines, consumer=arrivals).unwrap()
    delays = [now - float(line.split()[0]) for now, line in arrivals.lines if line[:1].isdigit()]
    rows.append((f"output delivery, {len(delays)} lines (ms)", [1000 * d for d in delays]))

    if not args.no_faults:
        rows.append(
            ("rank raises -> caller's error", [fault_latency(raises_after, "RAISED", tempfile.mkdtemp())])
        )
        rows.append(
            ("rank SIGKILL -> caller's error", [fault_latency(killed_after, "KILLED", tempfile.mkdtemp())])
        )
        removed, took = node_fault(cluster, "remove")
        rows.append(("remove_node call -> caller's error", [removed]))
        rows.append(("  of which remove_node() itself (killing the node's processes)", [took or 0.0]))
        raylet, died = node_fault(cluster, "raylet")
        rows.append(("raylet SIGKILL -> caller's error", [raylet]))
        rows.append(("raylet SIGKILL -> its rank dead", [died or float("nan")]))

    print(
        f"\n{time.strftime('%Y-%m-%d')}, {platform.node()}, {os.cpu_count()} cores, Ray {ray.__version__}\n"
    )
    print("| measure (seconds unless said) | median | samples |")
    print("|---|---|---|")
    for name, samples in rows:
        shown = ", ".join(f"{s:.3f}" for s in samples[:8]) + (" ..." if len(samples) > 8 else "")
        print(f"| {name} | {statistics.median(samples):.3f} | {shown} |")
    from air_magic.backends.ray import placement

    placement.release_all()
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()
