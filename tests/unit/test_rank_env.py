"""Each rank's environment: torchrun's variables from where the backend places the rank."""

from air_magic.launch.accelerators import GPU, AcceleratorPlan
from air_magic.launch.rank_env import RankPlace, rank_environment

GPUS = tuple(GPU(i, f"GPU-{i}", "NVIDIA H200") for i in range(4))


def _env(place, master_addr="10.0.0.1", gpus=None):
    plan = AcceleratorPlan(world_size=place.world_size, gpus=GPUS, detected="GPU_4xH200")
    return rank_environment(
        place=place, plan=plan, master_addr=master_addr, master_port=29600, call_id="r",
        call_dir="/d", log_dir="/l", lifeline_fd=3, extra={}, base={}, gpus=gpus,
    )  # fmt: skip


def test_one_node_gives_torchruns_single_node_numbers():
    env = _env(RankPlace.on_one_node(3, 4), master_addr="127.0.0.1")
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK")} == {
        "RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "NODE_RANK": "0",
    }  # fmt: skip
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29600")
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_the_second_node_of_two_gets_its_own_place_and_gpus():
    """Multi-node ready: the backend says where the rank stands and what its node has."""
    place = RankPlace(rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1)
    env = _env(place, gpus=GPUS[2:])
    assert (env["RANK"], env["LOCAL_RANK"], env["NODE_RANK"], env["GROUP_RANK"]) == ("5", "1", "1", "1")
    assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["ROLE_RANK"]) == ("8", "4", "5")
    assert env["MASTER_ADDR"] == "10.0.0.1"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    # Across machines the collectives cannot stay on loopback.
    assert "GLOO_SOCKET_IFNAME" not in env and "NCCL_SOCKET_IFNAME" not in env


def test_every_variable_the_launcher_sets_is_kept_by_a_sessions_ranks():
    """One list (protocol/env_names.LAUNCH_NAMES): a session cell never overwrites what the launcher gave."""
    from air_magic.protocol.env_names import kept_by_the_ranks

    places = ((RankPlace.on_one_node(1, 4), "127.0.0.1"), (RankPlace.on_one_node(0, 1), "10.0.0.1"))
    for place, addr in places:
        env = _env(place, master_addr=addr)  # base={}: every name is the launcher's
        assert [name for name in env if not kept_by_the_ranks(name)] == []


def test_torchruns_other_variables_and_accelerates_cpu_switch():
    place = RankPlace(rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1, node_count=2)
    env = _env(place)
    assert env["GROUP_WORLD_SIZE"] == "2"
    assert env["TORCHELASTIC_ERROR_FILE"] == "/d/torchelastic-error-5.json"  # in the call's private folder
    assert env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    assert "ACCELERATE_USE_CPU" not in env  # GPU ranks
    cpu = AcceleratorPlan(world_size=2, gpus=(), detected="cpu")
    made = rank_environment(
        place=RankPlace.on_one_node(0, 2), plan=cpu, master_addr="127.0.0.1", master_port=1, call_id="r",
        call_dir="/d", log_dir="/l", lifeline_fd=3, extra={}, base={},
    )  # fmt: skip
    assert made["ACCELERATE_USE_CPU"] == "1"  # as `accelerate launch --cpu` sets it
    mine = rank_environment(
        place=RankPlace.on_one_node(0, 2), plan=cpu, master_addr="127.0.0.1", master_port=1, call_id="r",
        call_dir="/d", log_dir="/l", lifeline_fd=3, extra={}, base={"ACCELERATE_USE_CPU": "0"},
    )  # fmt: skip
    assert mine["ACCELERATE_USE_CPU"] == "0"  # the user's own choice stays
