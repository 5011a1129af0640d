"""Where a Ray call's ranks go: the fewest nodes that fit, reserved with a placement group, one agent each.

:func:`plan_shape` decides how many ranks each node gets from the cluster's
nodes (one rank per GPU; CPU slots on a cluster without GPUs), filling the
biggest nodes first so the call spans as few machines as it can.
:class:`Pool` reserves that shape with a placement group (one bundle per node,
``STRICT_SPREAD`` across them), waits for it *at most*
``AIR_MAGIC_RAY_PLACE_WAIT`` seconds (Ray's own ``pg.ready()`` waits forever
for a request the cluster cannot place), and puts a :class:`~.agent.NodeAgent`
in each bundle, holding its GPUs. The pool outlives the call: the next call of
the same shape finds its agents (and their warm starters) ready, which is what
makes a warm call take milliseconds. A call of another shape, :func:`release_all`
or the end of this Python process releases it.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from air_magic.backends.ray import cluster
from air_magic.errors import AcceleratorError, ConfigurationError, LaunchError
from air_magic.launch.accelerators import (
    GPU,
    AcceleratorPlan,
    AcceleratorSpec,
    cpu_forced,
    default_cpu_ranks,
    describe,
)
from air_magic.protocol import env_names

PLACE_WAIT_S = 10.0
# The node agents start as Ray starts a worker process on each node, all at once: on a big cluster
# (or many simulated nodes on few cores, where they all finish together) that takes longer than any
# fixed wait. So the first answer may take AGENT_STALL_S plus AGENT_START_PER_NODE_S a node (at most
# AGENT_FIRST_EXTRA_MAX_S more), and after it the wait goes on while agents keep answering, failing
# once AGENT_STALL_S pass without a new one.
AGENT_STALL_S = 60.0
AGENT_START_PER_NODE_S = 3.0
AGENT_FIRST_EXTRA_MAX_S = 240.0
AGENT_CONCURRENCY = 8  # poll, stop, start... of one call at once: never a queue behind a long poll
AGENT_NAMESPACE = "air_magic"  # where a Ray job's agents are named (agent_name)
_named_for: str | None = None  # the Ray job whose agents get names (name_agents)


@dataclass(frozen=True)
class Shape:
    """Ranks per node (rank 0's node first), counted in ``unit`` ('GPU' or 'CPU')."""

    unit: str
    counts: tuple[int, ...]
    model: str | None = None

    @property
    def world_size(self) -> int:
        return sum(self.counts)


def plan_shape(
    nodes: list[dict[str, Any]],
    n: int | None,
    spec: AcceleratorSpec | None,
    here: str,
    free: dict[str, dict[str, float]] | None = None,
) -> Shape:
    """How many ranks each node gets; raises AcceleratorError when the cluster cannot hold them.

    ``free`` (node id -> resources free now), when given, is preferred: the shape then fits
    what is free, if anything does; else the shape is planned on what the nodes have, and the
    placement group waits (time-boxed) for it.
    """
    alive = [node for node in nodes if node.get("Alive")]
    has_gpus = any(node["Resources"].get("GPU", 0) >= 1 for node in alive)
    if spec is not None and not has_gpus:
        raise AcceleratorError(
            f"accelerator_type {spec.name} was asked for, but the Ray cluster has no GPUs: {listing(nodes)}"
        )
    unit = "GPU" if has_gpus else "CPU"
    model = spec.model if spec is not None else None
    if model is not None:
        alive = [node for node in alive if node["Resources"].get(f"accelerator_type:{model}")]
        if not alive:
            raise AcceleratorError(
                f"accelerator_type {spec.name if spec else model} was asked for, but no node of the Ray "
                f"cluster has {model} GPUs: {listing(nodes)}"
            )
    sizes = [(int(node["Resources"].get(unit, 0)), node) for node in alive]
    total = sum(size for size, _ in sizes)
    if n is None:
        if unit == "GPU":
            n = spec.count if spec is not None and spec.count is not None else total
        else:
            n = default_cpu_ranks()
    if n > total or n < 1:
        raise AcceleratorError(
            f"{n} rank(s) of one {unit} each were asked for, but the Ray cluster has {total} {unit}(s) "
            f"in all: {listing(nodes)}. Ask for fewer (num_accelerators=) or add nodes; nothing was launched."
        )
    if free is not None:
        now = [(int(free.get(node["NodeID"], {}).get(unit, 0)), node) for _, node in sizes]
        if sum(size for size, _ in now) >= n:
            sizes = now
    # Biggest nodes first (fewest nodes); among equals, the caller's node first, then a stable order.
    sizes.sort(key=lambda item: (-item[0], item[1]["NodeID"] != here, item[1]["NodeID"]))
    counts, left = [], n
    for size, _ in sizes:
        if left == 0:
            break
        take = min(size, left)
        if take:
            counts.append(take)
            left -= take
    return Shape(unit=unit, counts=tuple(counts), model=model)


def listing(nodes: list[dict[str, Any]]) -> str:
    """The cluster's nodes and what each has, for an error message."""
    parts = []
    for node in nodes:
        res = node.get("Resources", {})
        has = ", ".join(f"{res[k]:g} {k}" for k in ("GPU", "CPU") if res.get(k))
        types = [k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")]
        state = "" if node.get("Alive") else " (dead)"
        kinds = " " + "/".join(types) if types else ""
        parts.append(f"{node.get('NodeManagerAddress', '?')}{state}: {has or 'nothing'}{kinds}")
    return "; ".join(parts) or "no nodes"


def place_wait_s() -> float:
    raw = os.environ.get(env_names.RAY_PLACE_WAIT)
    if raw is None:
        return PLACE_WAIT_S
    try:
        return max(0.1, float(raw))
    except ValueError:
        raise ConfigurationError(f"{env_names.RAY_PLACE_WAIT}={raw!r} must be a number of seconds") from None


def _agents_described(ray: Any, agents: list[Any]) -> list[dict[str, Any]]:
    """Each agent's description, in order, once all have started: waited for while they keep
    coming (the first within :func:`_first_agent_wait_s`, each next within AGENT_STALL_S of the one
    before; else the call fails, naming how many started)."""
    refs = [agent.describe.remote() for agent in agents]
    pending = list(refs)
    wait = _first_agent_wait_s(len(refs))
    deadline = time.monotonic() + wait
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if ready:
            wait = AGENT_STALL_S
            deadline = time.monotonic() + wait
            continue
        started = len(refs) - len(pending)
        raise LaunchError(
            f"the air_magic agents of the Ray nodes did not all start: {started} of {len(refs)} "
            f"answered, and none in the last {wait:g} s (Ray could not start a worker process on the "
            "others' nodes: their logs under the Ray session's logs folder say why). Nothing was launched."
        )
    return list(ray.get(refs))


def _first_agent_wait_s(nodes: int) -> float:
    return AGENT_STALL_S + min(AGENT_START_PER_NODE_S * nodes, AGENT_FIRST_EXTRA_MAX_S)


class Pool:
    """A shape's reservation and its agents, one per node; :meth:`release` gives it all back."""

    def __init__(self, shape: Shape, force_cpu: bool):
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from air_magic.backends.ray.agent import NodeAgent

        ray = cluster.connect()
        self.shape = shape
        self.force_cpu = force_cpu
        self.agents: list[Any] = []
        self.nodes: list[dict[str, Any]] = []
        self.broken = False  # a node of it was lost: the next call builds a new pool
        self.in_use = threading.Lock()  # one call at a time on a pool
        bundles = [self._bundle(count) for count in shape.counts]
        strategy = "STRICT_SPREAD" if len(bundles) > 1 else "PACK"
        self.group = placement_group(bundles, strategy=strategy)
        try:  # from here on, any way out (Ctrl-C included) gives the reservation back
            wait = place_wait_s()
            ready, _ = ray.wait([self.group.ready()], timeout=wait)
            if not ready:
                raise AcceleratorError(
                    f"the Ray cluster could not place {shape.world_size} rank(s) as {list(shape.counts)} "
                    f"{shape.unit}(s) per node within {wait:g} s (AIR_MAGIC_RAY_PLACE_WAIT): they are in "
                    f"use or the nodes are gone. Free now: {_free(ray)}. Nodes: {listing(ray.nodes())}. "
                    "Nothing was launched."
                )
            remote = ray.remote(NodeAgent)
            for index, count in enumerate(shape.counts):
                options: dict[str, Any] = {
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        self.group, placement_group_bundle_index=index
                    ),
                    "max_concurrency": AGENT_CONCURRENCY,
                    "max_restarts": 0,
                }
                if _named_for is not None:
                    options.update(name=agent_name(_named_for, index), namespace=AGENT_NAMESPACE)
                if shape.unit == "GPU":
                    options.update(num_gpus=count, num_cpus=0)
                else:
                    options.update(num_cpus=count)
                self.agents.append(remote.options(**options).remote())
            self.nodes = _agents_described(ray, self.agents)
        except BaseException:
            self.release()
            raise
        self.plan = self._plan()

    def _bundle(self, count: int) -> dict[str, float]:
        bundle: dict[str, float] = {self.shape.unit: float(count)}
        if self.shape.model is not None:
            bundle[f"accelerator_type:{self.shape.model}"] = 0.001 * count
        return bundle

    def _plan(self) -> AcceleratorPlan:
        gpus: list[GPU] = []
        real = self.shape.unit == "GPU" and not self.force_cpu
        for node, count in zip(self.nodes, self.shape.counts, strict=True):
            found = [GPU(**g) for g in node["gpus"]]
            if len(found) < count:
                real = False  # a node without an NVIDIA driver (or fake GPUs): CPU ranks with gloo
            gpus.extend(found[:count])
        per_node = " + ".join(
            f"{node['ip']} ({_what(node, count, real)})"
            for node, count in zip(self.nodes, self.shape.counts, strict=True)
        )
        return AcceleratorPlan(
            world_size=self.shape.world_size,
            gpus=tuple(gpus) if real else (),
            detected=f"Ray: {per_node}",
        )

    def alive(self) -> bool:
        if self.broken:
            return False
        ray = cluster.connect()
        try:
            ray.get([agent.ping.remote() for agent in self.agents], timeout=10)
            return True
        except Exception:  # noqa: BLE001 - an agent or its node died: the pool is rebuilt
            return False

    def release(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        for agent in self.agents:
            try:
                ray.kill(agent)  # its process ends; the lifelines of its ranks close
            except Exception:  # noqa: BLE001 - already dead
                pass
        self.agents = []
        try:
            remove_placement_group(self.group)
        except Exception:  # noqa: BLE001 - already removed, or the cluster is gone
            pass


def _what(node: dict[str, Any], count: int, real: bool) -> str:
    return describe([GPU(**g) for g in node["gpus"]][:count]) if real else f"{count} CPU rank(s)"


def _free(ray: Any) -> str:
    free = ray.available_resources()
    return ", ".join(f"{free[k]:g} {k}" for k in ("GPU", "CPU") if k in free) or "nothing"


_lock = threading.Lock()
_pool: Pool | None = None


def name_agents(call_id: str) -> None:
    """Name the agents of this process's pools after Ray job ``call_id`` (its supervisor calls this):
    another driver of the cluster -- ``job_stacks``, for a follower on another machine -- can then
    find them with :func:`named_agents`. Only for a job: it has one call, so the names never clash."""
    global _named_for
    _named_for = call_id


def agent_name(call_id: str, index: int) -> str:
    return f"air_magic-{call_id}-agent-{index}"


def named_agents(ray: Any, call_id: str) -> list[Any]:
    """The agents of Ray job ``call_id``'s call, node by node (none once it has ended)."""
    found: list[Any] = []
    while True:
        try:
            found.append(ray.get_actor(agent_name(call_id, len(found)), namespace=AGENT_NAMESPACE))
        except ValueError:  # no actor of that name: past the last node
            return found


def pool_for(n: int | None, spec: AcceleratorSpec | None) -> Pool:
    """The pool for a call asking for ``n`` ranks (and ``spec``), reserved for it (its ``in_use``
    held: the caller releases it when the call ends or will not run): the current one when it fits."""
    global _pool
    ray = cluster.connect()
    force_cpu = cpu_forced()
    with _lock:
        here = ray.get_runtime_context().get_node_id()
        if _pool is not None:
            if not _pool.in_use.acquire(blocking=False):
                raise LaunchError(
                    "another call of this process is running (or starting) on the Ray cluster: one "
                    "call at a time (its ranks hold the reserved nodes); wait for it or cancel it"
                )
            # The pool serves any call for as many ranks of the same kind, however it was laid out
            # (it was planned on what was free then).
            try:
                wanted = plan_shape(ray.nodes(), n, spec, here)
            except BaseException:
                _pool.in_use.release()
                raise
            same = (wanted.world_size, wanted.unit, wanted.model) == (
                _pool.shape.world_size,
                _pool.shape.unit,
                _pool.shape.model,
            )
            if same and _pool.force_cpu == force_cpu and _pool.alive():
                return _pool  # reserved above
            _pool.release()
            _pool = None
        shape = plan_shape(ray.nodes(), n, spec, here, _free_per_node())
        pool = Pool(shape, force_cpu)
        pool.in_use.acquire()  # new, so free: reserved for this call
        _pool = pool
        return pool


def _free_per_node() -> dict[str, dict[str, float]] | None:
    """What each node has free now (Ray's own accounting); None where this Ray does not say."""
    try:
        from ray._private import state

        return dict(state.available_resources_per_node())
    except Exception:  # noqa: BLE001 - a private API: without it, plan on what the nodes have
        return None


def release_all(force: bool = False) -> None:
    """Give the cluster back every reservation and agent of this process (not under a running
    call, unless ``force``: the process is exiting)."""
    global _pool
    with _lock:
        if _pool is not None:
            if _pool.in_use.locked() and not force:
                raise LaunchError("a call of this process is running on the Ray cluster; it holds the nodes")
            _pool.release()
            _pool = None


def current() -> Pool | None:
    return _pool


atexit.register(release_all, force=True)
