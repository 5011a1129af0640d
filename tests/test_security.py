"""What the threat model in docs/security.md promises, checked on real runs."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

import air_magic
from air_magic import distributed, rank_entry, wire


def _sockets_seen_from_a_rank():
    import os

    import psutil

    def describe(proc):
        return sorted(
            (c.status, c.laddr.ip, c.laddr.port, c.raddr.ip if c.raddr else None)
            for c in proc.net_connections(kind="inet")
        )

    return {
        "caller": describe(psutil.Process(int(os.environ["AIR_MAGIC_CALLER_PID"]))),
        "rank": describe(psutil.Process()),
        "port": int(os.environ["MASTER_PORT"]),
    }


def test_the_only_socket_of_a_call_is_the_loopback_store_and_the_payload_does_not_use_it():
    big = b"p" * (5 * 2**20)  # a 5 MB argument: it travels as a file, not over a socket
    fn = distributed(num_accelerators=2, display="none", tracking=False)(
        lambda data: _sockets_seen_from_a_rank()
    )
    for seen in fn.distributed(big):
        port = seen["port"]
        listening = [c for c in seen["caller"] if c[0] == "LISTEN"]
        assert listening == [("LISTEN", "127.0.0.1", port, None)]
        # The rest is the store's own client connection to itself (torch's TCPStore makes one):
        # loopback only.
        for _status, local_ip, _port, remote_ip in seen["caller"]:
            assert local_ip.removeprefix("::ffff:") == "127.0.0.1"
            assert remote_ip is None or remote_ip.removeprefix("::ffff:") == "127.0.0.1"
        assert len(seen["caller"]) <= 3
        assert seen["rank"] == []  # the ranks opened no socket: they read the payload from a file


def _gloo_listeners():
    import os

    import psutil
    import torch.distributed as dist

    dist.init_process_group("gloo")
    listening = {
        c.laddr.ip
        for pid in (os.getpid(), int(os.environ["AIR_MAGIC_CALLER_PID"]))
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
    from air_magic.tracking import embedded_dir

    assert stat.S_IMODE(os.stat(embedded_dir()).st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o755, 0o770])
def test_a_rank_refuses_a_payload_from_a_folder_others_can_write(tmp_path, mode):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / wire.LAUNCH_FILE).write_text(json.dumps({"sys_path": sys.path, "argv": [""]}))
    (run_dir / wire.PAYLOAD_FILE).write_bytes(b"not even a pickle")
    os.chmod(run_dir, mode)
    env = dict(os.environ, RANK="0")
    done = subprocess.run(
        [sys.executable, "-c", rank_entry.BOOTSTRAP, str(run_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "refusing to load the payload" in done.stderr and "not a private folder" in done.stderr
