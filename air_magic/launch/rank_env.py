"""The environment each rank starts with: torchrun's variables and air_magic's own.

Built from the caller's environment, so a rank sees what the notebook sees,
plus the settings' ``env`` extras. The user's function initialises the
process group itself (``init_process_group("nccl")`` or ``"gloo"``), exactly
as under torchrun.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from air_magic.backends.local.rendezvous import LOOPBACK
from air_magic.launch.accelerators import AcceleratorPlan
from air_magic.protocol import wire


def rank_environment(
    *,
    rank: int,
    plan: AcceleratorPlan,
    port: int,
    run_id: str,
    run_dir: str,
    log_dir: str,
    lifeline_fd: int,
    extra: Mapping[str, str],
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    world = plan.world_size
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "NODE_RANK": "0",
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world),
            "ROLE_NAME": "default",
            "MASTER_ADDR": LOOPBACK,
            "MASTER_PORT": str(port),
            # The launcher hosts the store (see rendezvous.py); every rank is a client.
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "PYTHONUNBUFFERED": "1",
            # A failed collective aborts the communicator instead of hanging until the watchdog.
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            wire.ENV_RUN_ID: run_id,
            wire.ENV_RUN_DIR: run_dir,
            wire.ENV_LOG_DIR: log_dir,
            wire.ENV_LIFELINE_FD: str(lifeline_fd),
            wire.ENV_CALLER_PID: str(os.getpid()),
            wire.ENV_BACKEND: plan.backend,
            wire.ENV_DEVICE: "cpu" if plan.cpu_mode else "cuda",
        }
    )
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
    # Sockets of the collectives on loopback: one machine needs no other interface, and a rank
    # listening on eth0 is reachable from the network. gloo serves CPU tensors on GPU runs too
    # (init_process_group() with no backend makes both). The user's own setting wins.
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if not plan.cpu_mode:
        # NCCL's bootstrap sockets (and its socket transport, which a single node does not use:
        # NVLink, P2P and shared memory carry the data). '=lo' is an exact match; a bare 'lo' is a
        # prefix. InfiniBand is left alone (NCCL_IB_HCA chooses it, not this variable).
        env.setdefault("NCCL_SOCKET_IFNAME", "=lo")
        # Indices in NVML's (PCI bus) order, with CUDA told to count the same way: tools
        # parse this variable as integers (DeepSpeed's accelerator does), so UUIDs broke
        # them. MIG instances have no index of their own and keep their UUIDs.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(
            g.uuid if g.uuid.startswith("MIG-") else str(g.index) for g in plan.gpus
        )
    env.update(extra)
    return env
