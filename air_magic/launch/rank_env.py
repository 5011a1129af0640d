"""The environment each rank starts with: torchrun's variables and air_magic's own.

Built from the caller's environment, so a rank sees what the notebook sees,
plus the settings' ``env`` extras. The user's function initialises the
process group itself (``init_process_group("nccl")`` or ``"gloo"``), exactly
as under torchrun.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from air_magic.launch.accelerators import GPU, AcceleratorPlan
from air_magic.protocol import env_names
from air_magic.protocol.elastic_error_file import error_file_path

SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's default (its --signals-to-handle)


@dataclass(frozen=True)
class RankPlace:
    """Where a rank stands: in the whole world, and on its node (torchrun's numbers)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    node_count: int = 1

    @classmethod
    def on_one_node(cls, rank: int, world_size: int) -> RankPlace:
        return cls(rank, world_size, local_rank=rank, local_world_size=world_size, node_rank=0)


def rank_environment(
    *,
    place: RankPlace,
    plan: AcceleratorPlan,
    master_addr: str,
    master_port: int,
    call_id: str,
    call_dir: str,
    log_dir: str,
    lifeline_fd: int,
    extra: Mapping[str, str],
    base: Mapping[str, str] | None = None,
    gpus: Sequence[GPU] | None = None,
) -> dict[str, str]:
    """The rank's whole environment. The backend says where the rank stands (``place``), where the
    rendezvous store listens (``master_addr``/``master_port``; loopback for the local backend) and,
    on a node of its own, which of the plan's GPUs that node has (``gpus``; default all of them)."""
    env = dict(os.environ if base is None else base)
    world = place.world_size
    env.update(
        {
            "RANK": str(place.rank),
            "LOCAL_RANK": str(place.local_rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(place.local_world_size),
            "NODE_RANK": str(place.node_rank),
            "GROUP_RANK": str(place.node_rank),
            "GROUP_WORLD_SIZE": str(place.node_count),
            "ROLE_RANK": str(place.rank),
            "ROLE_WORLD_SIZE": str(world),
            "ROLE_NAME": "default",
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            # The launcher hosts the store (see rendezvous.py); every rank is a client.
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RUN_ID": call_id,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            # Where torch's @record writes this rank's exception (protocol/elastic_error_file.py).
            "TORCHELASTIC_ERROR_FILE": error_file_path(call_dir, place.rank),
            # What torchrun's launcher sets for its ranks: the signals its agent forwards as they are.
            "TORCHELASTIC_SIGNALS_TO_HANDLE": env.get("TORCHELASTIC_SIGNALS_TO_HANDLE", SIGNALS_TO_HANDLE),
            "PYTHONUNBUFFERED": "1",
            # A failed collective aborts the communicator instead of hanging until the watchdog.
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            env_names.CALL_ID: call_id,
            env_names.RUN_DIR: call_dir,
            env_names.LOG_DIR: log_dir,
            env_names.LIFELINE_FD: str(lifeline_fd),
            env_names.CALLER_PID: str(os.getpid()),
            env_names.BACKEND: plan.backend,
            env_names.DEVICE: "cpu" if plan.cpu_mode else "cuda",
        }
    )
    if "OMP_NUM_THREADS" not in env:  # torchrun leaves it at 1; the node's cores shared out is faster
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // place.local_world_size))
    # Sockets of the collectives on loopback: one machine needs no other interface, and a rank
    # listening on eth0 is reachable from the network. gloo serves CPU tensors on GPU runs too
    # (init_process_group() with no backend makes both). The user's own setting wins.
    loopback = master_addr in ("127.0.0.1", "localhost", "::1")
    if loopback:  # one machine; a backend across machines chooses its interfaces (or leaves them to NCCL)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if plan.cpu_mode:
        # Accelerate picks its multi-process CPU mode only when told (`accelerate launch --cpu` sets
        # it); without it, on a machine with no GPU, every rank would train alone.
        env.setdefault("ACCELERATE_USE_CPU", "1")
    else:
        # NCCL's bootstrap sockets (and its socket transport, which a single node does not use:
        # NVLink, P2P and shared memory carry the data). '=lo' is an exact match; a bare 'lo' is a
        # prefix. InfiniBand is left alone (NCCL_IB_HCA chooses it, not this variable).
        if loopback:
            env.setdefault("NCCL_SOCKET_IFNAME", "=lo")
        # Indices in NVML's (PCI bus) order, with CUDA told to count the same way: tools
        # parse this variable as integers (DeepSpeed's accelerator does), so UUIDs broke
        # them. MIG instances have no index of their own and keep their UUIDs.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(
            g.uuid if g.uuid.startswith("MIG-") else str(g.index)
            for g in (plan.gpus if gpus is None else gpus)
        )
    env.update(extra)
    return env
