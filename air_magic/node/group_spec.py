"""What one node needs to start its ranks of a call: the spec a rank group is made from.

The caller makes it (``GroupSpec.of_call``: the local call for its one node,
``backends/ray/run_loop.py`` for each Ray node, where it travels as it is); the
rank group (``rank_group.py``) starts its ranks from it (``rank_start.py``), each
with torchrun's variables for its place (:meth:`GroupSpec.rank_environments`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from air_magic.launch.accelerators import AcceleratorPlan, detect_gpus
from air_magic.launch.rank_env import RankPlace, rank_environment
from air_magic.launch.request import LaunchRequest
from air_magic.protocol import env_names


@dataclass(frozen=True)
class GroupSpec:
    """What a node needs to start its ranks of a call (it travels to a Ray node as it is)."""

    call_id: str
    ranks: tuple[int, ...]  # their global ranks, in local-rank order
    plan: AcceleratorPlan  # the call's plan (its world size, CPU or GPU)
    node_rank: int
    master_addr: str
    master_port: int
    log_dir: str  # the call's log folder (on the caller's machine)
    env: dict[str, str] = field(default_factory=dict)  # the call's env=, and the tracking variables
    sys_path: tuple[str, ...] = ()
    argv: tuple[str, ...] = ("",)
    cwd: str = ""
    warm_start: bool = True
    starter_wait_s: float = 0.0  # how long the ranks may wait for the warm starter to become ready
    session: bool = False  # a persistent session: its answer pipes are watched
    by_agent: bool = False  # run by a Ray node's agent: that node's GPUs; metric files shipped
    log_root: str | None = None  # where the warm starter's log goes
    node_count: int = 1  # the nodes of the call (torchrun's GROUP_WORLD_SIZE)

    @classmethod
    def of_call(
        cls,
        request: LaunchRequest,
        *,
        ranks: Iterable[int],
        master: tuple[str, int],
        **where: Any,
    ) -> GroupSpec:
        """The spec of one node's ranks of ``request``, as this process stands now (its sys.path, argv
        and folder); ``where``: the other fields (call_id, log_dir, node_rank, warm_start...)."""
        return cls(
            ranks=tuple(ranks),
            plan=request.plan,
            master_addr=master[0],
            master_port=master[1],
            env=dict(request.env),
            sys_path=tuple(sys.path),
            argv=tuple(sys.argv) or ("",),
            cwd=os.getcwd(),
            session=request.channel is not None,
            **where,
        )

    def rank_environments(
        self, call_dir: str, lifeline_fd: int, metrics_dir: str | None
    ) -> list[dict[str, str]]:
        """Each of this node's ranks' whole environment, in local-rank order."""
        plan, gpus = self.plan, self.plan.gpus
        if self.by_agent and not plan.cpu_mode:  # the GPUs Ray gave this node's agent
            gpus = tuple(detect_gpus())
            plan = replace(plan, gpus=gpus)
        extra = dict(self.env)
        if metrics_dir is not None and env_names.METRICS_DIR in extra:
            extra[env_names.METRICS_DIR] = metrics_dir
        local_world = len(self.ranks)
        return [
            rank_environment(
                place=RankPlace(rank, plan.world_size, local, local_world, self.node_rank, self.node_count),
                plan=plan,
                master_addr=self.master_addr,
                master_port=self.master_port,
                call_id=self.call_id,
                call_dir=call_dir,
                log_dir=self.log_dir,
                lifeline_fd=lifeline_fd,
                extra=extra,
                gpus=gpus,
            )
            for local, rank in enumerate(self.ranks)
        ]
