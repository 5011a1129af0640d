"""A worker node of a running Ray head, on 127.0.0.1: ``python ray_worker_node.py GCS_ADDRESS CPUS GPUS``.

``ray start --address`` would not do for tests: on Linux it starts a worker node only with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1``, and then takes the machine's address (a connection
off loopback). This starts the node's processes as ``ray.cluster_utils.Cluster.add_node``
does, with every listener on 127.0.0.1, prints ``ready`` once the node is in the cluster, and
waits; the test ends the node by killing this process's group (all of its processes).
"""

from __future__ import annotations

import os
import sys
import time

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported (NOTES.md)

import ray
from ray._private.node import Node
from ray._private.parameter import RayParams


def main(gcs: str, cpus: int, gpus: int) -> None:
    params = RayParams(
        gcs_address=gcs,
        node_ip_address="127.0.0.1",
        num_cpus=cpus,
        num_gpus=gpus,
        object_store_memory=150 * 1024 * 1024,
        min_worker_port=0,
        max_worker_port=0,
        include_log_monitor=False,
        node_manager_port=0,
    )
    params.dashboard_agent_listen_port = None  # any free port: the head's agent has the default
    node = Node(params, head=False, shutdown_at_exit=False, spawn_reaper=False)
    ray.init(address=gcs, _node_ip_address="127.0.0.1", log_to_driver=False)
    deadline = time.monotonic() + 60
    while not any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
        assert time.monotonic() < deadline, "the node did not join"
        time.sleep(0.2)
    ray.shutdown()
    print("ready", node.node_id, flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
