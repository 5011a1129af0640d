"""The Ray backend's pure parts, without a cluster: where ranks go, what a collateral error is,
how the cluster setting reads. (The real cluster: test_ray.py and the contract suite.)"""

from __future__ import annotations

import pytest

from air_magic.backends.ray.placement import listing, plan_shape
from air_magic.errors import AcceleratorError, ConfigurationError
from air_magic.launch.accelerators import parse_accelerator_type
from air_magic.launch.settings import make_settings
from air_magic.outcome.failures import is_collateral


def node(node_id: str, gpus: float = 0, cpus: float = 8, alive: bool = True, model: str | None = None):
    resources = {"CPU": cpus}
    if gpus:
        resources["GPU"] = gpus
    if model:
        resources[f"accelerator_type:{model}"] = 1
    return {
        "NodeID": node_id,
        "Alive": alive,
        "Resources": resources,
        "NodeManagerAddress": f"10.0.0.{node_id}",
    }


def test_ranks_fill_the_biggest_nodes_first_so_the_call_spans_the_fewest():
    nodes = [node("1", gpus=2), node("2", gpus=8), node("3", gpus=4)]
    assert plan_shape(nodes, 8, None, here="1").counts == (8,)
    assert plan_shape(nodes, 10, None, here="1").counts == (8, 2)
    assert plan_shape(nodes, None, None, here="1").counts == (8, 4, 2)  # default: every GPU


def test_among_equal_nodes_the_callers_comes_first():
    nodes = [node("1", gpus=4), node("2", gpus=4)]
    assert plan_shape(nodes, 2, None, here="2").counts == (2,)
    shape = plan_shape(nodes, 6, None, here="2")
    assert (shape.unit, shape.counts, shape.world_size) == ("GPU", (4, 2), 6)


def test_without_gpus_cpu_slots_stand_in(monkeypatch):
    monkeypatch.delenv("AIR_MAGIC_CPU_RANKS", raising=False)
    nodes = [node("1", cpus=2), node("2", cpus=2)]
    assert plan_shape(nodes, None, None, here="1").counts == (2,)
    shape = plan_shape(nodes, 3, None, here="1")
    assert (shape.unit, shape.counts) == ("CPU", (2, 1))


def test_the_cpu_ranks_variable_is_read_by_one_rule_on_ray_as_here(monkeypatch):
    nodes = [node("1", cpus=8)]
    monkeypatch.setenv("AIR_MAGIC_CPU_RANKS", "3")
    assert plan_shape(nodes, None, None, here="1").counts == (3,)
    monkeypatch.setenv("AIR_MAGIC_CPU_RANKS", "many")  # once a bare ValueError from int() here
    with pytest.raises(ConfigurationError, match="AIR_MAGIC_CPU_RANKS='many' must be a positive integer"):
        plan_shape(nodes, None, None, here="1")


def test_free_resources_are_preferred_when_they_fit():
    nodes = [node("1", gpus=8), node("2", gpus=4)]
    free = {"1": {"GPU": 1}, "2": {"GPU": 4}}  # node 1 is busy with another job
    assert plan_shape(nodes, 4, None, here="1", free=free).counts == (4,)
    # Not enough free anywhere: planned on what the nodes have (the placement then waits, bounded).
    assert plan_shape(nodes, 8, None, here="1", free=free).counts == (8,)


def test_a_request_larger_than_the_cluster_names_what_it_has():
    nodes = [node("1", gpus=2), node("2", gpus=1, alive=False)]
    with pytest.raises(AcceleratorError) as caught:
        plan_shape(nodes, 3, None, here="1")
    message = str(caught.value)
    assert "2 GPU(s) in all" in message and "10.0.0.1: 2 GPU, 8 CPU" in message and "(dead)" in message


def test_accelerator_type_keeps_to_nodes_of_that_model():
    nodes = [node("1", gpus=8, model="A100"), node("2", gpus=8, model="H100")]
    shape = plan_shape(nodes, None, parse_accelerator_type("GPU_8xH100"), here="1")
    assert (shape.counts, shape.model) == ((8,), "H100")
    with pytest.raises(AcceleratorError, match="no node of the Ray cluster has B300"):
        plan_shape(nodes, None, parse_accelerator_type("GPU_8xB300"), here="1")
    with pytest.raises(AcceleratorError, match="has no GPUs"):
        plan_shape([node("1")], None, parse_accelerator_type("GPU_8xH100"), here="1")
    assert "A100" in listing(nodes)


@pytest.mark.parametrize(
    ("type_name", "message", "collateral"),
    [
        ("torch.distributed.DistBackendError", "NCCL error: remote process exited", True),
        (
            "builtins.RuntimeError",
            "[../third_party/gloo/...] Connection closed by peer [127.0.0.1]:1234",
            True,
        ),
        ("builtins.RuntimeError", "Gloo connectFullMesh failed", True),
        ("torch.distributed.DistStoreError", "Timed out after 300 seconds waiting for clients", True),
        ("builtins.RuntimeError", "Failed to restore checkpoint from /ckpt", False),  # "store" in a word
        ("builtins.RuntimeError", "DataLoader worker timed out", False),
        ("builtins.ValueError", "loss is nan (gloo)", False),  # the user's own type: the user's failure
        ("builtins.RuntimeError", "CUDA out of memory", False),
    ],
)
def test_collateral_errors_are_torch_distributeds_not_the_users(type_name, message, collateral):
    assert is_collateral(type_name, message) is collateral


def test_the_cluster_setting():
    assert make_settings().cluster is None
    assert make_settings(cluster="local").cluster is None
    assert make_settings(cluster="ray").cluster == "ray"
    assert make_settings(cluster="Ray= 10.0.0.5:6379 ").cluster == "ray=10.0.0.5:6379"
    for bad in ("spark", "ray=", 3):
        with pytest.raises(ConfigurationError, match="cluster must be"):
            make_settings(cluster=bad)


class _SlowAgents:
    """Ray's ``wait``/``get`` as seen by the pool while its node agents start: ``answers`` says
    whether an agent answers at each wait (False: none within the wait); the timeouts are kept."""

    def __init__(self, answers: list[bool]):
        self.answers = answers
        self.timeouts: list[float] = []

    def wait(self, pending, num_returns, timeout):
        assert num_returns == 1
        self.timeouts.append(timeout)
        if self.answers and self.answers.pop(0):
            return pending[:1], pending[1:]
        return [], pending

    def get(self, refs):
        return [{"ref": r} for r in refs]


class _Agent:
    def __init__(self, i: int):
        self.describe = type("Remote", (), {"remote": staticmethod(lambda i=i: i)})


def test_node_agents_are_waited_for_while_they_keep_starting_and_a_stall_is_named():
    from air_magic.backends.ray import placement
    from air_magic.errors import LaunchError

    slow = _SlowAgents([True] * 64)
    described = placement._agents_described(slow, [_Agent(i) for i in range(64)])
    assert [d["ref"] for d in described] == list(range(64))
    first = placement.AGENT_STALL_S + placement.AGENT_START_PER_NODE_S * 64  # all start at once
    assert first - 1 < slow.timeouts[0] <= first and all(
        t <= placement.AGENT_STALL_S for t in slow.timeouts[1:]
    )
    assert placement._first_agent_wait_s(1000) == placement.AGENT_STALL_S + placement.AGENT_FIRST_EXTRA_MAX_S

    stalled = _SlowAgents([True] * 10 + [False])
    with pytest.raises(LaunchError, match=r"did not all start: 10 of 64 answered, and none in the last 60 s"):
        placement._agents_described(stalled, [_Agent(i) for i in range(64)])
