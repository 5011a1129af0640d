"""The Ray backend beyond the contract suite: ranks across nodes, node faults, placement, output, security.

Every test runs on the real 3-node Ray cluster of ``conftest.ray_cluster`` (one fake
GPU per node, so a call of 3 ranks puts one on each node; the ranks use gloo on the
CPU). After each test nothing of the call is left: no rank process (``no_leftovers``),
no placement group or agent beyond the one pool that is kept for the next call
(``_nothing_left``).
"""

from __future__ import annotations

import inspect
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from helpers.recording import Recorder, Recording

from air_magic.calls.call import run_call
from air_magic.calls.history import last_run
from air_magic.errors import AcceleratorError, RankFailedError
from air_magic.launch.settings import make_settings
from air_magic.protocol.events import RankOutput, RankStarted


@pytest.fixture
def cluster(ray_cluster):
    yield ray_cluster
    _nothing_left()


SEEN_AGENTS: set[int] = set()  # pids of every node agent of this session's calls


def _call_folders() -> list[str]:
    """Call folders left on the nodes (their agents' temp folder: /tmp here) by agents of this
    session, alive or dead (another session's Ray on this machine has folders of its own)."""
    import glob
    import tempfile

    from air_magic.private_files import _OWNED_NAME

    roots = {"/tmp", os.environ.get("TMPDIR") or "/tmp"} - {tempfile.gettempdir()}
    found = []
    for root in roots:
        for path in glob.glob(os.path.join(root, "air_magic-20*")):
            owner = _OWNED_NAME.match(os.path.basename(path))
            if owner is not None and int(owner["pid"]) in SEEN_AGENTS:
                found.append(path)
    return found


def _nothing_left() -> None:
    import ray
    from ray.util.placement_group import placement_group_table

    from air_magic.backends.ray import placement

    pool = placement.current()
    kept = {pool.group.id.hex()} if pool is not None else set()
    if pool is not None:
        SEEN_AGENTS.update(node["pid"] for node in pool.nodes)
    deadline = time.monotonic() + 30  # a removed node's agent stays ALIVE in Ray's records ~15 s
    while True:
        groups = {k for k, v in placement_group_table().items() if v["state"] != "REMOVED"}
        actors = [a for a in ray._private.state.actors().values() if a["State"] == "ALIVE"]
        agents = len(pool.agents) if pool is not None else 0
        folders = _call_folders()
        if groups <= kept and len(actors) <= agents and not folders:
            return
        assert time.monotonic() < deadline, (
            f"left behind: groups {groups - kept}, actors {len(actors)} (agents {agents}), folders {folders}"
        )
        time.sleep(0.1)


def call(fn, *args, n=3, recorder=None, backend=None, **settings):
    from air_magic.backends.ray.backend import RayBackend

    settings.setdefault("display", "none")
    settings.setdefault("tracking", False)
    made = make_settings(num_accelerators=n, cluster="ray", **settings)
    backend = backend or RayBackend()
    if recorder is not None:
        backend = Recording(backend, recorder)
    return run_call(fn.__name__, fn, inspect.signature(fn).bind(*args), made, backend=backend)


# -- rank functions ------------------------------------------------------------------------


def where_am_i():
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK")
    env = {k: int(os.environ[k]) for k in names}
    return env, os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], os.getpid()


def all_reduce_ranks():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(os.environ["RANK"])])
    dist.all_reduce(t)
    dist.barrier()
    dist.destroy_process_group()
    return t.item()


class TrainingDiverged(ValueError):
    pass


def last_rank_raises_in_a_collective():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    if os.environ["RANK"] == "2":
        raise TrainingDiverged("loss nan on node 2")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 2 never joins: the others fail here once it is gone
    time.sleep(60)


def same_lines():
    for _ in range(5):
        print("epoch 1 loss 0.25", flush=True)
    return True


def sleeps(ready_dir):
    open(os.path.join(ready_dir, os.environ["RANK"]), "w").close()
    time.sleep(600)


def logs_metrics():
    import mlflow

    for step in range(5):
        mlflow.log_metric(f"loss_rank_{os.environ['RANK']}", 1.0 / (step + 1), step=step)
    return True


# -- tests ---------------------------------------------------------------------------------


def _remember_agents() -> None:
    from air_magic.backends.ray import placement

    pool = placement.current()
    if pool is not None:
        SEEN_AGENTS.update(node["pid"] for node in pool.nodes)


def test_ranks_span_nodes_with_torchruns_variables(cluster):
    from air_magic.backends.ray import placement

    values = call(where_am_i).unwrap()
    envs = [v[0] for v in values]
    assert [e["RANK"] for e in envs] == [0, 1, 2]
    assert [e["NODE_RANK"] for e in envs] == [0, 1, 2] == [e["GROUP_RANK"] for e in envs]
    assert {e["LOCAL_RANK"] for e in envs} == {0} and {e["LOCAL_WORLD_SIZE"] for e in envs} == {1}
    assert {e["WORLD_SIZE"] for e in envs} == {3}
    assert {v[1] for v in values} == {"127.0.0.1"} and len({v[2] for v in values}) == 1
    # Each rank is a descendant of its own node's agent.
    agents = [node["pid"] for node in placement.current().nodes]
    assert len(set(agents)) == 3
    for (_env, _addr, _port, pid), agent in zip(values, agents, strict=True):
        assert pid != agent  # the rank has exited; the agent that started it is alive
        assert psutil.pid_exists(agent)


def test_gloo_all_reduce_across_nodes(cluster):
    assert call(all_reduce_ranks).unwrap() == [3.0, 3.0, 3.0]
    assert last_run().outcome == "succeeded"


@pytest.mark.fault(
    "a rank on another Ray node raises while the others wait in a collective",
    "its own exception and traceback, not the collective errors it caused in the others",
)
def test_the_rank_that_raised_is_the_root_cause_not_the_collective_errors_it_caused(cluster):
    with pytest.raises(TrainingDiverged) as caught:
        call(last_rank_raises_in_a_collective).unwrap()
    assert caught.value.air_magic_rank == 2
    assert str(caught.value) == "loss nan on node 2"
    assert "in last_rank_raises_in_a_collective" in str(caught.value.__cause__)
    assert last_run().rank_states[2] == "failed"


def test_identical_lines_of_two_ranks_are_all_shown_each_with_its_rank(cluster):
    recorder = Recorder()
    assert call(same_lines, n=2, recorder=recorder).unwrap() == [True, True]
    for rank in (0, 1):
        text = "".join(e.text for e in recorder.events if isinstance(e, RankOutput) and e.rank == rank)
        assert text.splitlines() == ["epoch 1 loss 0.25"] * 5
    assert not any("repeated" in e.text for e in recorder.events if isinstance(e, RankOutput))


@pytest.mark.fault("a Ray request larger than the cluster", "fails at once, before launch, listing it")
def test_a_request_larger_than_the_cluster_fails_at_once_listing_it(cluster):
    before = last_run()
    started = time.monotonic()
    with pytest.raises(AcceleratorError) as caught:
        call(where_am_i, n=5)
    assert time.monotonic() - started < 10
    message = str(caught.value)
    assert "5 rank(s)" in message and "3 GPU(s) in all" in message and "127.0.0.1" in message
    assert last_run() is before  # nothing was launched


@pytest.mark.fault(
    "a Ray request for GPUs another job holds", "fails after AIR_MAGIC_RAY_PLACE_WAIT, listing what is free"
)
def test_a_request_for_gpus_in_use_fails_within_the_place_wait(cluster, monkeypatch):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from air_magic.backends.ray import placement

    placement.release_all()
    other = placement_group([{"GPU": 1}, {"GPU": 1}], strategy="STRICT_SPREAD")  # someone else's job
    ray.get(other.ready(), timeout=60)
    monkeypatch.setenv("AIR_MAGIC_RAY_PLACE_WAIT", "2")
    try:
        started = time.monotonic()
        with pytest.raises(AcceleratorError, match="could not place 2 rank"):
            call(where_am_i, n=2)
        assert time.monotonic() - started < 15
    finally:
        remove_placement_group(other)


@pytest.mark.fault(
    "a short timeout runs out while new Ray agents still import torch",
    "DistributedTimeoutError; no rank is left running on any node",
)
def test_a_timeout_while_the_nodes_start_leaves_no_rank(cluster):
    from air_magic.backends.ray import placement
    from air_magic.errors import DistributedTimeoutError

    placement.release_all()  # new agents: their warm starters import torch during the call
    with pytest.raises(DistributedTimeoutError):
        call(sleeps, "/nonexistent", timeout=1).unwrap()
    assert last_run().outcome == "timeout"
    assert call(where_am_i).outcome == "succeeded"  # the pool serves the next call


def _rank_on_a_worker_node(cluster):
    """A rank whose node is not the head (removing the head would end the driver), and that node.
    Which bundle of the placement group lands on which node is Ray's choice."""
    from air_magic.backends.ray import placement

    by_id = {n.node_id: n for n in cluster.list_all_nodes()}
    for rank, described in enumerate(placement.current().nodes):
        node = by_id[described["node_id"]]
        if node is not cluster.head_node:
            return rank, node
    raise AssertionError("every rank is on the head node")


def _run_in_thread(fn, *args, **settings):
    import threading

    box: dict[str, object] = {}

    def target() -> None:
        started = time.monotonic()
        try:
            box["result"] = call(fn, *args, **settings)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc
        box["elapsed"] = time.monotonic() - started

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def _wait_ready(ready_dir, n: int) -> None:
    deadline = time.monotonic() + 60
    while len(os.listdir(ready_dir)) < n:
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _add_node_back(cluster) -> None:
    """A new node for the next tests; a call on new agents (each sweeps the call folders that
    the agents of the dead node could not remove: that is checked after the test)."""
    from air_magic.backends.ray import placement

    placement.release_all()
    cluster.add_node(**cluster.node_args)
    cluster.wait_for_nodes()
    assert call(where_am_i).outcome == "succeeded"


@pytest.mark.fault("a Ray node is removed mid-run", "the call fails at once naming the node; its ranks die")
def test_a_node_removed_mid_run_fails_the_call_and_its_ranks_die(cluster, tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    recorder = Recorder()
    thread, box = _run_in_thread(sleeps, str(ready), recorder=recorder)
    _wait_ready(ready, 3)
    pids = {e.rank: e.pid for e in recorder.events if isinstance(e, RankStarted)}
    rank, node = _rank_on_a_worker_node(cluster)
    _remember_agents()
    try:
        removed = time.monotonic()
        cluster.remove_node(node, allow_graceful=False)
        thread.join(60)
        assert not thread.is_alive()
        assert time.monotonic() - removed < 30
        result = box["result"]
        with pytest.raises(RankFailedError, match="was lost during the call") as caught:
            result.unwrap()
        assert caught.value.rank == rank
        assert all(
            not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie" for pid in pids.values()
        )
    finally:
        _add_node_back(cluster)


@pytest.mark.fault("a Ray node's raylet is SIGKILLed mid-run", "its ranks die within seconds; the call fails")
def test_a_killed_raylet_takes_its_ranks_with_it(cluster, tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    recorder = Recorder()
    thread, box = _run_in_thread(sleeps, str(ready), recorder=recorder)
    _wait_ready(ready, 3)
    pids = {e.rank: e.pid for e in recorder.events if isinstance(e, RankStarted)}
    rank, node = _rank_on_a_worker_node(cluster)
    _remember_agents()
    try:
        raylet = node.all_processes["raylet"][0].process
        killed = time.monotonic()
        raylet.send_signal(signal.SIGKILL)
        while _alive(pids[rank]):
            assert time.monotonic() - killed < 10, "the ranks of the dead raylet's node are still alive"
            time.sleep(0.05)
        thread.join(90)
        assert not thread.is_alive()
        with pytest.raises(RankFailedError, match="was lost during the call"):
            box["result"].unwrap()
    finally:
        try:
            cluster.remove_node(node, allow_graceful=False)
        finally:
            _add_node_back(cluster)  # the cluster serves the rest of the run: three nodes again


def test_rank_metrics_reach_the_tracked_run_through_the_agents(cluster, store):
    assert call(logs_metrics, n=2, tracking=True).unwrap() == [True, True]
    run = store.get_run(last_run().mlflow_run_id)
    assert run.info.status == "FINISHED"
    for rank in (0, 1):
        history = store.get_metric_history(run.info.run_id, f"loss_rank_{rank}")
        assert [m.step for m in history] == [0, 1, 2, 3, 4]


def test_the_cell_magic_runs_on_ray(cluster, ip, capsys):
    ip.run_cell_magic(
        "distributed",
        "-n 3 --cluster ray --display text --no-tracking",
        "import os\nprint('node', os.environ['NODE_RANK'])\nresult = int(os.environ['RANK'])",
    )
    out = capsys.readouterr().out
    for rank in range(3):
        assert f"[rank {rank}] node {rank}" in out
    assert last_run().outcome == "succeeded"


def test_the_command_line_runs_on_ray(cluster, tmp_path):
    from helpers.cli import invoke

    from air_magic.backends.ray import placement

    placement.release_all()  # this process's agents hold the GPUs: the command is another driver

    (tmp_path / "where.py").write_text(
        "import os\nprint('node', os.environ['NODE_RANK'], 'of', os.environ['WORLD_SIZE'])\n"
    )
    done = invoke(
        "run", "--no-tracking", "-n", "3", "--cluster", f"ray={cluster.address}", "where.py", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    for rank in range(3):
        assert f"[rank {rank}] node {rank} of 3" in done.stdout


def test_ray_launch_runs_the_function_once_as_a_driver_of_the_cluster(cluster):
    import air_magic

    @air_magic.ray_launch(num_accelerators=3, display="none", tracking=False)
    def driver():
        import ray

        ray.init(log_to_driver=False)  # RAY_ADDRESS: the cluster

        @ray.remote(num_gpus=1)
        def where():
            return ray.get_runtime_context().get_node_id()

        nodes = ray.get([where.remote() for _ in range(3)])
        return ray.cluster_resources()["GPU"], len(nodes), os.environ.get("CUDA_VISIBLE_DEVICES")

    assert driver.distributed() == [(3.0, 3, "")]
    with pytest.raises(AcceleratorError, match="4 rank"):
        driver.with_overrides(num_accelerators=4).distributed()


def test_ray_init_starts_a_local_ray_on_loopback_with_a_private_token(tmp_path):
    script = textwrap.dedent(
        """
        import json, os, sys, psutil
        import air_magic
        info = air_magic.ray_init()
        again = air_magic.ray_init()
        mine = psutil.Process().children(recursive=True)
        listening = set()
        for proc in mine:
            try:
                for conn in proc.net_connections(kind="inet"):
                    if conn.status == psutil.CONN_LISTEN:
                        listening.add(conn.laddr.ip)
            except psutil.Error:
                pass
        import ray
        print(json.dumps({"address": info.address, "again": again.address, "token": info.token_path,
                          "listening": sorted(listening), "dashboard": info.dashboard_url,
                          "usage": os.environ.get("RAY_USAGE_STATS_ENABLED")}))
        ray.shutdown()
        """
    )
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts["address"].startswith("127.0.0.1:") and facts["again"] == facts["address"]
    loopback = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}  # IPv4-mapped loopback is loopback too
    assert facts["listening"] and set(facts["listening"]) <= loopback, facts["listening"]
    assert facts["dashboard"] is None and facts["usage"] == "0"
    assert stat.S_IMODE(os.stat(facts["token"]).st_mode) == 0o600
    assert facts["token"].startswith(str(tmp_path / "state"))
    assert "started a local Ray (listening on 127.0.0.1 only)" in proc.stderr


CALLER = textwrap.dedent(
    """
    import os, sys, time
    import ray
    ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)
    from air_magic import distributed

    def sleeper(folder):
        with open(os.path.join(folder, os.environ["RANK"]), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)

    run = distributed(num_accelerators=3, cluster="ray", display="none", tracking=False)(sleeper)
    run.distributed(sys.argv[2])
    """
)


@pytest.mark.fault(
    "the caller of a Ray call is SIGKILLed mid-run", "every rank on every node dies within seconds"
)
def test_when_the_caller_dies_every_rank_on_every_node_dies(cluster, tmp_path):
    from air_magic.backends.ray import placement

    placement.release_all()  # the GPUs this session's agents hold go to the other caller
    ready = tmp_path / "ready"
    ready.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER, cluster.address, str(ready)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while len(os.listdir(ready)) < 3:
            assert caller.poll() is None, caller.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        time.sleep(0.2)  # every pid is written
        pids = [int((ready / name).read_text()) for name in os.listdir(ready)]
        caller.kill()
        caller.wait()
        killed = time.monotonic()
        while [pid for pid in pids if _alive(pid)]:
            assert time.monotonic() - killed < 45, "ranks outlived their caller"
            time.sleep(0.05)
    finally:
        if caller.poll() is None:
            caller.kill()
        caller.communicate()


def test_a_persistent_session_on_ray_keeps_each_ranks_state_across_nodes(cluster, ip):
    from IPython.utils.capture import capture_output

    from air_magic.calls import persistent

    def cell(body: str, line: str = "") -> object:
        with capture_output() as captured:
            result = ip.run_cell_magic("distributed", line, body)
        return result, captured.stdout

    with capture_output():
        session = ip.run_line_magic(
            "distributed", "session start -n 3 --cluster ray --display text --no-tracking --timeout 60"
        )
    try:
        _, out = cell(
            "import os, torch, torch.distributed as dist\nnode = os.environ['NODE_RANK']\nprint('on', node)"
        )
        for rank in range(3):
            assert f"[rank {rank}] on {rank}" in out  # output before the answer, per rank
        values, _ = cell("t = torch.tensor([float(node)])\ndist.all_reduce(t)\n(node, t.item())")
        assert values == [("0", 3.0), ("1", 3.0), ("2", 3.0)]  # each rank kept its own `node`
        with pytest.raises(KeyError, match="only rank 2"):
            cell("import os\nif os.environ['RANK'] == '2':\n    raise KeyError('only rank 2')\n")
        with pytest.raises(TimeoutError, match="goes on"):
            cell("import time\ntime.sleep(60)", "--timeout 2")  # SIGINT through each node's agent
        values, _ = cell("node")
        assert values == ["0", "1", "2"] and persistent.active() is session
    finally:
        session.stop(quiet=True)
    assert persistent.active() is None


def test_a_background_run_on_ray_answers_like_a_local_one(cluster, tmp_path):
    """``distributed_async`` with ``cluster="ray"`` (issue 35): the handle's status, logs, stacks
    and cancel; a second call meanwhile is refused clearly; then one that returns its values."""
    import air_magic
    from air_magic.errors import LaunchError

    ready = tmp_path / "ready"
    ready.mkdir()
    on_ray = air_magic.distributed(num_accelerators=3, cluster="ray", display="none", tracking=False)
    handle = on_ray(sleeps).distributed_async(str(ready))
    # Another call while it starts (a call of another size would release the pool under it) is
    # refused before anything of either is touched; so is ray_launch, which gives the pool back.
    with pytest.raises(LaunchError, match="one call at a time"):
        call(where_am_i, n=2)
    with pytest.raises(LaunchError, match="holds the nodes"):
        air_magic.ray_launch(num_accelerators=1, display="none", tracking=False)(where_am_i).distributed()
    _wait_ready(ready, 3)
    _remember_agents()
    assert handle.status == "running" and sorted(handle.rank_pids) == [0, 1, 2]
    dump = handle.stacks()
    assert sorted(dump) == [0, 1, 2] and all("sleeps" in dump[rank] for rank in dump), dump
    with pytest.raises(LaunchError, match="one call at a time"):
        call(where_am_i)
    pids = list(handle.rank_pids.values())
    assert handle.cancel() is True and handle.status == "cancelled"
    assert all(not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie" for pid in pids)
    again = on_ray(same_lines).distributed_async()
    assert again.result(timeout=120) == [True, True, True]
    assert again.logs(2).count("epoch 1 loss 0.25") == 5
