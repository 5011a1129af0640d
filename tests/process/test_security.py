"""What the threat model in docs/security.md promises, checked on real runs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

import pytest
from helpers.paths import script

import air_magic
from air_magic import distributed, paths
from air_magic.errors import ConfigurationError
from air_magic.node import warm
from air_magic.protocol import wire
from air_magic.worker import entry as rank_entry


def _sockets_seen_from_a_rank():
    import os

    import psutil

    def describe(pid):
        return sorted(
            (c.status, c.laddr.ip, c.laddr.port, c.raddr.ip if c.raddr else None)
            for c in psutil.Process(pid).net_connections(kind="inet")
        )

    port = int(os.environ["MASTER_PORT"])
    listens = psutil.net_connections(kind="inet")
    host = next(c.pid for c in listens if c.status == psutil.CONN_LISTEN and c.laddr.port == port)
    caller = int(os.environ["AIR_MAGIC_CALLER_PID"])
    return {
        "store": describe(host),  # warm: a fork of the starter serves it; fresh: the caller
        "caller": describe(caller) if host != caller else [],
        "rank": describe(os.getpid()),
        "port": port,
    }


def test_the_only_socket_of_a_call_is_the_loopback_store_and_the_payload_does_not_use_it():
    big = b"p" * (5 * 2**20)  # a 5 MB argument: it travels as a file, not over a socket
    fn = distributed(num_accelerators=2, display="none", tracking=False)(
        lambda data: _sockets_seen_from_a_rank()
    )
    for seen in fn.distributed(big):
        port = seen["port"]
        listening = [c for c in seen["store"] if c[0] == "LISTEN"]
        assert listening == [("LISTEN", "127.0.0.1", port, None)]
        # The rest is the store's own client connection to itself (torch's TCPStore makes one):
        # loopback only.
        for _status, local_ip, _port, remote_ip in seen["store"]:
            assert local_ip.removeprefix("::ffff:") == "127.0.0.1"
            assert remote_ip is None or remote_ip.removeprefix("::ffff:") == "127.0.0.1"
        assert len(seen["store"]) <= 3
        assert seen["caller"] == []  # the caller, when it does not serve the store, opened no socket
        assert seen["rank"] == []  # the ranks opened no socket: they read the payload from a file


def _gloo_listeners():
    import os

    import psutil
    import torch.distributed as dist

    dist.init_process_group("gloo")
    port = int(os.environ["MASTER_PORT"])
    every = psutil.net_connections(kind="inet")
    store_host = next(c.pid for c in every if c.status == psutil.CONN_LISTEN and c.laddr.port == port)
    listening = {
        c.laddr.ip
        for pid in (os.getpid(), int(os.environ["AIR_MAGIC_CALLER_PID"]), store_host)
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }
    dist.barrier()
    dist.destroy_process_group()
    return sorted(listening)


def test_with_gloo_every_listening_socket_is_on_loopback():
    for ips in distributed(num_accelerators=2, display="none", tracking=False)(_gloo_listeners).distributed():
        assert ips == ["127.0.0.1"]


def test_log_and_mlflow_folders_are_private():
    distributed(num_accelerators=2, display="none")(lambda: 1).distributed()
    info = air_magic.last_run()
    assert stat.S_IMODE(os.stat(info.log_dir).st_mode) == 0o700
    for rank in (0, 1):
        assert stat.S_IMODE(os.stat(info.log_path(rank)).st_mode) == 0o600
    from air_magic.paths import embedded_mlflow_dir as embedded_dir

    assert stat.S_IMODE(os.stat(embedded_dir()).st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o755, 0o770])
def test_a_rank_refuses_a_payload_from_a_folder_others_can_write(tmp_path, mode):
    call_dir = tmp_path / "run"
    call_dir.mkdir()
    (call_dir / wire.LAUNCH_FILE).write_text(json.dumps({"sys_path": sys.path, "argv": [""]}))
    (call_dir / wire.PAYLOAD_FILE).write_bytes(b"not even a pickle")
    os.chmod(call_dir, mode)
    env = dict(os.environ, RANK="0")
    done = subprocess.run(
        [sys.executable, "-c", rank_entry.BOOTSTRAP, str(call_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "refusing to load the payload" in done.stderr and "not a private folder" in done.stderr


# -- item 11, "private means private" --------------------------------------------------------------

NOBODY = 65534  # another local user (tests run as root, which can hand files to any uid)


def _quiet():
    return 1


def _modes_under(root):
    """Every folder and file under ``root`` whose mode is not 0700 (folders) or 0600 (files)."""
    loose = []
    for folder, _dirs, files in os.walk(root):
        if stat.S_IMODE(os.lstat(folder).st_mode) != 0o700:
            loose.append((folder, oct(stat.S_IMODE(os.lstat(folder).st_mode))))
        for name in files:
            path = os.path.join(folder, name)
            if stat.S_IMODE(os.lstat(path).st_mode) != 0o600:
                loose.append((path, oct(stat.S_IMODE(os.lstat(path).st_mode))))
    return loose


@pytest.mark.parametrize(
    ("root_mode", "why"),
    [
        (0o1777, "writable by other users"),  # a shared log root: refused before the link is reached
        (0o700, "symbolic link"),  # ours now (planted while it was shared, say): the link is refused
    ],
    ids=["shared-root", "private-root"],
)
def test_a_starter_log_symlink_planted_by_another_user_is_refused_not_followed(tmp_path, root_mode, why):
    root = tmp_path / "logs"
    root.mkdir()
    os.chmod(root, root_mode)
    victim = tmp_path / "victim.txt"  # any file the victim can write; here one that does not exist yet
    planted = root / "starter.log"
    planted.symlink_to(victim)
    os.lchown(planted, NOBODY, NOBODY)
    with pytest.raises(ConfigurationError, match=why):
        warm.Starter([], str(planted)).close()
    assert not victim.exists()  # O_CREAT through the link would have made it


def test_a_starter_log_owned_by_another_user_is_refused(tmp_path):
    root = tmp_path / "logs"
    root.mkdir(mode=0o700)
    theirs = root / "starter.log"
    theirs.write_bytes(b"")
    os.chmod(theirs, 0o666)
    os.chown(theirs, NOBODY, NOBODY)  # our output would land in a file they read
    with pytest.raises(ConfigurationError, match="owned by uid 65534"):
        warm.Starter([], str(theirs)).close()
    assert theirs.read_bytes() == b""


@pytest.mark.parametrize(
    ("mode", "owner", "group", "why"),
    [
        (0o700, NOBODY, -1, "owned by uid 65534"),  # a root someone else made (we did not create it)
        (0o777, -1, -1, "writable by other users"),
        (0o1777, -1, -1, "writable by other users"),  # sticky: they still can plant new names in it
        (0o770, -1, NOBODY, "group 65534 may write it"),  # a shared group's members are other users
    ],
    ids=["another-owner", "0777", "1777-sticky", "0770-shared-group"],
)
def test_a_log_root_that_is_not_ours_alone_is_refused_before_launch(tmp_path, mode, owner, group, why):
    root = tmp_path / "shared-logs"
    root.mkdir()
    os.chown(root, owner, group)
    os.chmod(root, mode)
    fn = distributed(num_accelerators=2, display="none", tracking=False, log_dir=str(root))(_quiet)
    with pytest.raises(ConfigurationError, match=why) as raised:
        fn.distributed()
    assert str(root) in str(raised.value) and "nothing was launched" in str(raised.value)
    assert os.listdir(root) == []


@pytest.mark.parametrize(
    "mode",
    [
        0o755,  # others may read it: the files in it are 0600 and each run's folder 0700
        0o770,  # its group is our own private group (umask-002 systems): no one else is in it
    ],
    ids=["0755", "0770-own-private-group"],
)
def test_a_log_root_of_ours_that_others_may_only_read_is_used(tmp_path, mode):
    import grp
    import pwd

    me = pwd.getpwuid(os.getuid())
    assert grp.getgrgid(me.pw_gid).gr_name == me.pw_name  # (here: root's group root)
    root = tmp_path / "readable-logs"
    root.mkdir()
    os.chown(root, -1, me.pw_gid)
    os.chmod(root, mode)
    assert distributed(num_accelerators=2, display="none", tracking=False, log_dir=str(root))(
        _quiet
    ).distributed() == [1, 1]


def test_a_log_root_inside_a_folder_another_user_can_replace_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)  # they can rename our folder away and put theirs in its place
    fn = distributed(num_accelerators=2, display="none", tracking=False, log_dir=str(theirs / "mine"))(_quiet)
    with pytest.raises(ConfigurationError, match="owned by uid 65534"):
        fn.distributed()


def test_an_embedded_store_folder_of_another_user_is_refused_before_launch(store, tmp_path, monkeypatch):
    theirs = tmp_path / "their-store"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    monkeypatch.setenv("AIR_MAGIC_MLFLOW_DIR", str(theirs))
    with pytest.raises(ConfigurationError, match="owned by uid 65534"):
        distributed(num_accelerators=2, display="none")(_quiet).distributed()
    assert os.listdir(theirs) == []


def test_the_embedded_store_and_the_starter_log_are_0600_files_in_0700_folders(store, tmp_path, monkeypatch):
    monkeypatch.setenv("AIR_MAGIC_MLFLOW_DIR", str(tmp_path / "fresh"))  # a store MLflow has not opened yet
    distributed(num_accelerators=2, display="none")(_quiet).distributed()  # logs, source, metrics
    from air_magic.paths import embedded_mlflow_dir as embedded_dir

    assert os.path.exists(os.path.join(embedded_dir(), "mlflow.db"))
    assert any("rank-0.log" in files for _d, _s, files in os.walk(embedded_dir()))  # the copies
    assert _modes_under(embedded_dir()) == []
    starter_log = tmp_path / "logs" / "starter.log"
    starter_log.parent.mkdir(mode=0o700)
    warm.Starter([], str(starter_log)).close()
    assert stat.S_IMODE(os.stat(starter_log).st_mode) == 0o600


def test_the_ui_server_log_and_everything_it_writes_are_private(store, tmp_path, monkeypatch):
    from air_magic.tracking import ui as mlflow_ui

    monkeypatch.setenv("AIR_MAGIC_MLFLOW_DIR", str(tmp_path / "fresh"))  # a store MLflow has not opened yet

    try:
        base = mlflow_ui.ensure_ui(paths.embedded_mlflow_uri())
        distributed(num_accelerators=2, display="none")(_quiet).distributed()
        import urllib.request

        with urllib.request.urlopen(f"{base}/health", timeout=10) as reply:
            assert reply.status == 200
    finally:
        mlflow_ui.stop_ui(paths.embedded_mlflow_uri())
    assert os.path.exists(os.path.join(paths.embedded_mlflow_dir(), "ui.log"))
    assert _modes_under(paths.embedded_mlflow_dir()) == []


TRACKED_CALLER = script("tracked_caller.py")


def test_the_next_call_sweeps_the_private_folders_of_a_sigkilled_caller_and_no_others(tmp_path):
    tmp = tempfile.gettempdir()
    ready = tmp_path / "ready"
    ready.mkdir()
    env = dict(os.environ, TMPDIR=tmp, AIR_MAGIC_WARM="0", AIR_MAGIC_MLFLOW_DIR=str(tmp_path / "mlflow"))
    caller = subprocess.Popen([sys.executable, TRACKED_CALLER, str(ready), "0"], env=env)
    try:
        deadline = time.monotonic() + 90
        while len(os.listdir(ready)) < 2:
            assert caller.poll() is None and time.monotonic() < deadline, "the caller's ranks did not start"
            time.sleep(0.05)
        theirs = sorted(n for n in os.listdir(tmp) if n.startswith("air_magic-"))
        assert any(n.startswith("air_magic-metrics-") for n in theirs), theirs
        # Its run folder (launch.json; payload.pkl until every rank has read it) and its metrics folder.
        assert any(os.path.exists(os.path.join(tmp, n, wire.LAUNCH_FILE)) for n in theirs), theirs
        # While the caller lives, a call of ours leaves its folders alone.
        distributed(num_accelerators=2, display="none", tracking=False)(_quiet).distributed()
        assert all(os.path.isdir(os.path.join(tmp, n)) for n in theirs)
        os.kill(caller.pid, signal.SIGKILL)
        caller.wait()
        # A folder of another user, named like the dead caller's, is not ours to remove.
        foreign = next(n for n in theirs if n.startswith("air_magic-metrics-"))
        dead_callers = [n for n in theirs if n != foreign]  # the run folder
        os.chown(os.path.join(tmp, foreign), NOBODY, NOBODY)
        # The next call removes what the dead caller left (a payload, had a rank not read it yet).
        distributed(num_accelerators=2, display="none", tracking=False)(_quiet).distributed()
        left = [n for n in dead_callers if os.path.exists(os.path.join(tmp, n))]
        assert left == [], f"folders of a dead caller left behind: {left}"
        assert os.path.isdir(os.path.join(tmp, foreign))
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()
        for name in os.listdir(tmp):  # whatever this test made or the caller left, for the suite's check
            if name.startswith("air_magic-"):
                shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)


def test_another_local_user_can_write_keys_of_a_calls_store_as_the_docs_say():
    """A property of torch's TCPStore (no authentication), stated in docs/security.md: during a call,
    a process of *another user* on this machine can set keys the ranks read."""

    def intrude_then_read():
        import datetime
        import os

        import torch.distributed as dist

        port = int(os.environ["MASTER_PORT"])
        if os.environ["RANK"] == "0":
            child = os.fork()
            if child == 0:  # another local user: uid 65534
                os.setgid(65534)
                os.setuid(65534)
                client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
                client.set("written-by-another-user", str(os.getuid()))
                os._exit(0)
            assert os.waitpid(child, 0)[1] == 0
        mine = dist.TCPStore(
            "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
        )
        return mine.get("written-by-another-user").decode()

    assert distributed(num_accelerators=2, display="none", tracking=False)(
        intrude_then_read
    ).distributed() == ["65534", "65534"]


def _gpu_plan():
    from air_magic.launch.accelerators import GPU, AcceleratorPlan

    gpus = (GPU(0, "GPU-0", "NVIDIA H200"), GPU(1, "GPU-1", "NVIDIA H200"))
    return AcceleratorPlan(world_size=2, gpus=gpus, detected="GPU_2xH200")


def _env_of_rank(plan, base, extra=None):
    from air_magic.launch.rank_env import RankPlace, rank_environment

    return rank_environment(
        place=RankPlace.on_one_node(0, plan.world_size), plan=plan, master_addr="127.0.0.1",
        master_port=12345, call_id="r", call_dir="/x", log_dir="/y",
        lifeline_fd=3, extra=extra or {}, base=base,
    )  # fmt: skip


def test_on_gpus_nccl_and_gloo_sockets_are_pinned_to_loopback_unless_the_user_chose():
    env = _env_of_rank(_gpu_plan(), base={})
    assert env["NCCL_SOCKET_IFNAME"] == "=lo"  # '=': exactly 'lo', not every name starting with it
    assert env["GLOO_SOCKET_IFNAME"] == "lo"
    # The user's own choice (their environment, or env= of the call) wins.
    assert _env_of_rank(_gpu_plan(), base={"NCCL_SOCKET_IFNAME": "eth0"})["NCCL_SOCKET_IFNAME"] == "eth0"
    assert _env_of_rank(_gpu_plan(), {}, {"GLOO_SOCKET_IFNAME": "ib0"})["GLOO_SOCKET_IFNAME"] == "ib0"
    # InfiniBand is left alone: NVLink/P2P inside the node do not use sockets.
    assert "NCCL_IB_DISABLE" not in env


def _nccl_listeners():
    import os

    import psutil
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    dist.all_reduce(torch.ones(1, device="cuda"))
    listening = sorted(
        {c.laddr.ip for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    )
    dist.barrier()
    dist.destroy_process_group()
    return listening


@pytest.mark.gpu
def test_with_nccl_every_listening_socket_of_a_rank_is_on_loopback():
    from air_magic.launch.accelerators import detect_gpus

    if not detect_gpus():
        pytest.skip("no NVIDIA GPU visible through NVML")
    n = min(2, len(detect_gpus()))
    for ips in distributed(num_accelerators=n, display="none", tracking=False)(_nccl_listeners).distributed():
        assert ips == ["127.0.0.1"]


SECRET_CALLER = """\
import air_magic


@air_magic.distributed(num_accelerators=2, display="none", run_name="hush", env={{"MY_TOKEN": "{secret}"}})
def uses_the_token(n):
    import os

    return os.environ["MY_TOKEN"] == "{secret}", n


print("RESULT", uses_the_token.distributed(3))
"""


def test_a_value_given_in_env_reaches_no_file_of_the_store_the_state_or_the_logs(store, tmp_path):
    """The decorator line is part of the recorded source: a secret written there in ``env=`` must
    not land in the run's ``source/`` artifact, a param, a tag or a log (issue 48, item 13)."""
    secret = f"tok-{os.urandom(16).hex()}"
    caller = tmp_path / "secret_caller.py"
    caller.write_text(SECRET_CALLER.format(secret=secret))
    state, logs = tmp_path / "state", tmp_path / "logs"
    env = dict(os.environ, XDG_STATE_HOME=str(state), AIR_MAGIC_LOG_DIR=str(logs))
    done = subprocess.run(
        [sys.executable, str(caller)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT [(True, 3), (True, 3)]" in done.stdout, done.stdout
    (run,) = store.search_runs([e.experiment_id for e in store.search_experiments()])
    assert run.info.run_name == "hush"
    source = store.download_artifacts(run.info.run_id, "source/uses_the_token.py", str(tmp_path / "dl"))
    with open(source) as f:
        recorded = f.read()
    assert '"MY_TOKEN": "***"' in recorded and "def uses_the_token" in recorded, recorded
    shutil.rmtree(tmp_path / "dl")
    found = []
    assert os.path.isdir(paths.embedded_mlflow_dir()) and os.path.isdir(logs)
    for root in (paths.embedded_mlflow_dir(), str(state), str(logs)):  # state: if the call made one
        for folder, _dirs, files in os.walk(root):
            for name in files:
                path = os.path.join(folder, name)
                with open(path, "rb") as f:
                    if secret.encode() in f.read():
                        found.append(path)
    assert found == []
