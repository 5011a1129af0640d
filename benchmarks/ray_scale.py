"""Many simulated Ray nodes on one machine: placement, start and teardown at scale (issue 34, item 1).

    python benchmarks/ray_scale.py --nodes 16 --gpus-per-node 8 [--warm]

A real Ray cluster of ``--nodes`` nodes on this machine (``ray.cluster_utils.Cluster``, loopback,
one CPU and ``--gpus-per-node`` fake GPUs each: Ray schedules by the count, no driver is touched),
then one air_magic call of nodes x gpus ranks on it through the Ray backend; the ranks are trivial
(each returns its rank variables). Reported: the cluster's start, the call's time (the pool --
placement group and one agent per node -- and the run), that every rank ran where the plan said
(RANK, LOCAL_RANK, NODE_RANK), and what was left afterwards: rank processes, and placement groups
once the pool is given back. ``--lose-node``: then a second call whose ranks sleep, and once every
rank is up, the Ray node of rank ``world * 5 // 9`` is removed (its raylet killed, as
``tests/ray_cluster`` does with a few nodes): reported are the seconds from the removal to the
call's end, the error's first line and what was left. The issue's target is 125 nodes x 8 (1,000 ranks) on a
16-core machine; a 2-core machine of 23 GB holds fewer (each node is a raylet and an agent).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def where() -> tuple[int, int, int, int]:
    import os

    return (int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["NODE_RANK"]), os.getpid())


def sleeps(ready: str) -> None:
    import os
    import time

    with open(os.path.join(ready, os.environ["RANK"]), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def _raylet_of(pid: int) -> int | None:
    """The pid of the raylet a rank runs under (rank <- node agent <- raylet)."""
    import psutil

    proc = psutil.Process(pid)
    while proc is not None:
        if proc.name() == "raylet":
            return proc.pid
        proc = proc.parent()
    return None


def lose_a_node(cluster: Any, settings: Any, backend: Any, world: int) -> dict[str, object]:
    """A call of sleeping ranks; remove the node of rank world*5//9 once all are up; time the end."""
    import tempfile
    import threading

    import psutil

    from air_magic.calls.call import run_call

    ready = tempfile.mkdtemp(prefix="ray-scale-ready-")
    box: dict[str, object] = {}

    def call() -> None:
        try:
            box["result"] = run_call(
                "sleeps", sleeps, inspect.signature(sleeps).bind(ready), settings, backend=backend
            )
        except BaseException as exc:  # noqa: BLE001 - reported
            box["result"] = exc
        box["ended"] = time.monotonic()

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    deadline = time.monotonic() + 400
    while len(os.listdir(ready)) < world and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.2)
    row: dict[str, object] = {"lose_ranks_up": len(os.listdir(ready))}
    if row["lose_ranks_up"] != world:
        row["lose_error"] = f"only {row['lose_ranks_up']} of {world} ranks came up: {box.get('result')!r}"[
            :400
        ]
        return row
    pids = {}
    for name in os.listdir(ready):
        with open(os.path.join(ready, name)) as f:
            pids[int(name)] = int(f.read())
    workers = {n.all_processes["raylet"][0].process.pid: n for n in cluster.worker_nodes}
    # The first rank from world*5//9 on that runs on a worker node (the head node stays).
    victim = next(r for r in [*range(world * 5 // 9, world), *range(world)] if _raylet_of(pids[r]) in workers)
    node = workers[_raylet_of(pids[victim])]
    removed = time.monotonic()
    cluster.remove_node(node, allow_graceful=False)
    thread.join(300)
    row["lose_rank"] = victim
    row["lose_to_end_s"] = round(float(box["ended"]) - removed, 2) if "ended" in box else None  # type: ignore[arg-type]
    result = box.get("result")
    error = (
        getattr(result, "error", None)
        if result is not None and not isinstance(result, BaseException)
        else result
    )
    row["lose_error"] = str(error).splitlines()[0][:300] if error is not None else None
    row["lose_error_rank"] = getattr(error, "rank", None)
    time.sleep(1)
    row["lose_rank_processes_left"] = sum(1 for p in pids.values() if psutil.pid_exists(p))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--warm", action="store_true", help="warm ranks (a warm starter per node)")
    parser.add_argument("--lose-node", action="store_true", help="then a call that loses a node (above)")
    args = parser.parse_args()
    # Before Ray is imported (it reads them then): every listener and address on 127.0.0.1, as the
    # test suite's cluster (tests/conftest.py, NOTES.md).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import psutil
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    ray_constants.ENABLE_RAY_CLUSTER = False

    from air_magic.backends.ray import placement
    from air_magic.backends.ray.backend import RayBackend
    from air_magic.calls.call import run_call
    from air_magic.launch.settings import make_settings

    t0 = time.monotonic()
    node = {"num_cpus": 1, "num_gpus": args.gpus_per_node, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    for _ in range(args.nodes - 1):
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    started = time.monotonic() - t0
    world = args.nodes * args.gpus_per_node
    row: dict[str, object] = {"nodes": args.nodes, "ranks": world, "cluster_start_s": round(started, 1)}
    try:
        settings = make_settings(
            num_accelerators=world, cluster="ray", display="none", tracking=False, warm_start=args.warm
        )
        backend = RayBackend(warm_start=args.warm)
        t1 = time.monotonic()
        values = run_call("where", where, inspect.signature(where).bind(), settings, backend=backend).values
        row["call_s"] = round(time.monotonic() - t1, 1)
        assert values is not None
        ranks = sorted(v[0] for v in values)
        by_node: dict[int, list[int]] = {}
        for _rank, local, node_rank, _pid in values:
            by_node.setdefault(node_rank, []).append(local)
        row["every_rank_once"] = ranks == list(range(world))
        row["nodes_used"] = len(by_node)
        row["local_ranks_right"] = all(sorted(v) == list(range(args.gpus_per_node)) for v in by_node.values())
        pids = [v[3] for v in values]
        time.sleep(1)
        row["rank_processes_left"] = sum(1 for p in pids if psutil.pid_exists(p))
        if args.lose_node:
            row.update(lose_a_node(cluster, settings, backend, world))
        placement.release_all(force=True)
        from ray.util.placement_group import placement_group_table

        groups = placement_group_table().values()
        row["placement_groups_left"] = sum(1 for v in groups if v["state"] != "REMOVED")
        row["caller_rss_mb"] = round(psutil.Process().memory_info().rss / 2**20)
        row["machine_used_gb"] = round(psutil.virtual_memory().used / 2**30, 1)
    except Exception as exc:  # noqa: BLE001 - the row says what failed
        row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
