"""Successful launches with real rank processes (SPEC §4, §5, §7 text mode)."""

from __future__ import annotations

import os
import socket
import stat
import sys
import threading
from pathlib import Path

import pytest
from helpers.paths import EXAMPLES

import air_magic
from air_magic import distributed


def _rank_facts():
    import os
    import sys

    keys = [
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
        "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "PYTHONUNBUFFERED",
        "TORCHELASTIC_USE_AGENT_STORE", "AIR_MAGIC_RUN_ID", "AIR_MAGIC_BACKEND", "AIR_MAGIC_DEVICE",
        "USER_EXTRA",
    ]  # fmt: skip
    return {
        "env": {k: os.environ.get(k) for k in keys},
        "cwd": os.getcwd(),
        "sys_path": list(sys.path),
        "executable": sys.executable,
        "pid": os.getpid(),
        "heavy": sorted(m for m in ("IPython", "ipywidgets", "torch") if m in sys.modules),
    }


def test_results_come_back_in_rank_order_with_the_rank_environment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    facts = distributed(num_accelerators=3, display="none", env={"USER_EXTRA": "yes"})(
        _rank_facts
    ).distributed()
    assert [f["env"]["RANK"] for f in facts] == ["0", "1", "2"]
    port = facts[0]["env"]["MASTER_PORT"]
    for rank, f in enumerate(facts):
        env = f["env"]
        assert env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        assert env["NODE_RANK"] == env["GROUP_RANK"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == port
        assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 3))
        assert env["PYTHONUNBUFFERED"] == "1" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert env["AIR_MAGIC_BACKEND"] == "gloo" and env["AIR_MAGIC_DEVICE"] == "cpu"
        assert env["USER_EXTRA"] == "yes"
        assert f["cwd"] == str(tmp_path)
        assert f["sys_path"] == sys.path
        assert f["executable"] == sys.executable
        assert f["pid"] != os.getpid()
        # The worker side never imports IPython or widgets; torch only when the warm starter preloaded it.
        assert f["heavy"] in ([], ["torch"])
    assert len({f["pid"] for f in facts}) == 3
    assert port != "29500"


def test_user_omp_num_threads_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    facts = distributed(num_accelerators=2, display="none")(_rank_facts).distributed()
    assert {f["env"]["OMP_NUM_THREADS"] for f in facts} == {"7"}


def _all_reduce(offset):
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(os.environ["RANK"]) + offset])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo_all_reduce(world):
    expected = sum(range(world)) + world * 0.5
    assert (
        distributed(num_accelerators=world, display="none")(_all_reduce).distributed(0.5)
        == [expected] * world
    )


def _helper_init():
    import torch
    import torch.distributed as dist

    device = air_magic.init_process_group()
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    backend = dist.get_backend()
    dist.destroy_process_group()
    return str(device), backend, t.item()


def test_init_process_group_helper_picks_gloo_on_cpu():
    assert distributed(display="none")(_helper_init).distributed() == [("cpu", "gloo", 2.0)] * 2


@pytest.mark.fault(
    "port 29500 held by another process; two calls at once", "both succeed, each on its own port"
)
def test_two_runs_at_once_and_a_squatter_on_29500_do_not_collide():
    squatter = socket.socket()
    try:
        squatter.bind(("127.0.0.1", 29500))
        squatter.listen()
    except OSError:
        pass  # someone already holds it: the point stands
    try:
        fn = distributed(num_accelerators=2, display="none")(_all_reduce)
        results: dict[int, object] = {}

        def go(i):
            try:
                results[i] = fn.distributed(float(i))
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                results[i] = exc

        threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == {0: [1.0, 1.0], 1: [3.0, 3.0]}
    finally:
        squatter.close()


def _listening_sockets_of_the_store_and_the_caller():
    import os

    import psutil

    port = int(os.environ["MASTER_PORT"])
    store = {
        c.laddr.ip
        for c in psutil.net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }
    parent = psutil.Process(int(os.environ["AIR_MAGIC_CALLER_PID"]))
    caller = {c.laddr.ip for c in parent.net_connections() if c.status == psutil.CONN_LISTEN}
    return sorted(store), sorted(caller)


@pytest.mark.parametrize("warm_start", [True, False], ids=["warm", "fresh"])
def test_the_store_and_the_caller_listen_on_loopback_only(warm_start):
    # Warm, the starter's fork serves the store (the caller listens on nothing); fresh, the caller does.
    where = distributed(num_accelerators=2, display="none", warm_start=warm_start)
    store, caller = where(_listening_sockets_of_the_store_and_the_caller).distributed()[0]
    assert store == ["127.0.0.1"]
    assert caller == ([] if warm_start else ["127.0.0.1"])


def test_notebook_style_closure_over_a_local_class_travels_by_value():
    class Scaler:
        def __init__(self, k):
            self.k = k

        def __call__(self, x):
            return self.k * x

    scale = Scaler(3)

    @distributed(num_accelerators=2, display="none")
    def work(x):
        import os

        return scale(x) + int(os.environ["RANK"])

    assert work.distributed(2) == [6, 7]


class _CountsPickling:
    pickled = 0

    def __reduce__(self):
        type(self).pickled += 1
        return (_CountsPickling, ())


def _noop(arg):
    return type(arg).__name__


def test_arguments_are_pickled_once_not_once_per_rank():
    _CountsPickling.pickled = 0
    assert (
        distributed(num_accelerators=4, display="none")(_noop).distributed(_CountsPickling())
        == ["_CountsPickling"] * 4
    )
    assert _CountsPickling.pickled == 1


def _returns_tensor():
    import os

    import torch

    return {"rank": int(os.environ["RANK"]), "t": torch.arange(3) * int(os.environ["RANK"])}


def test_tensors_come_back():
    out = distributed(num_accelerators=2, display="none")(_returns_tensor).distributed()
    assert [o["t"].tolist() for o in out] == [[0, 0, 0], [0, 1, 2]]


def _chatty(n):
    import ctypes
    import os
    import sys

    rank = os.environ["RANK"]
    for i in range(n):
        print(f"line {i} of rank {rank}")
    # A print flood is written in chunks (worker/live_stdout.py); descriptor-level writes go
    # straight to the pipe, so, as with a plain `python` whose stdout is a pipe, flush first.
    sys.stdout.flush()
    os.write(1, f"raw write from rank {rank}\n".encode())
    libc = ctypes.CDLL(None)
    libc.printf(f"C printf from rank {rank}\n".encode())
    libc.fflush(None)
    print(f"to stderr from rank {rank}", file=sys.stderr)
    sys.stdout.write("progress 10%\rprogress 50%\rprogress 100%\n")
    sys.stdout.write("no newline at the end")
    return rank


def test_output_is_captured_at_the_fd_level_logged_and_shown(capsys):
    n = 2000
    assert distributed(num_accelerators=2, display="text")(_chatty).distributed(n) == ["0", "1"]
    info = air_magic.last_run()
    assert info is not None and info.outcome == "succeeded"
    assert stat.S_IMODE(os.stat(info.log_dir).st_mode) == 0o700
    captured = capsys.readouterr()
    for rank in (0, 1):
        path = info.log_path(rank)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        log = Path(path).read_text().splitlines()
        numbered = [line for line in log if line.startswith("line ")]
        assert numbered == [f"line {i} of rank {rank}" for i in range(n)]  # all, in order
        for expected in (
            f"raw write from rank {rank}",
            f"C printf from rank {rank}",
            f"to stderr from rank {rank}",
        ):
            assert expected in log
        # The text display prefixes the rank, shows a redrawn bar once, and flushes a final partial line.
        assert f"[rank {rank}] line {n - 1} of rank {rank}" in captured.out
        assert f"[rank {rank}] C printf from rank {rank}" in captured.out
        assert f"[rank {rank}] progress 100%\n" in captured.out
        assert f"[rank {rank}] no newline at the end\n" in captured.out
        assert f"[rank {rank}] to stderr from rank {rank}" in captured.err
    assert "progress 50%" not in captured.out
    # What was shown is exactly what each rank printed, each line once, under its rank, in order. The
    # ranks interleave, and stdout and stderr are separate pipes: order holds per rank and stream.
    # stdout has nothing else; stderr also has air_magic's notes (and MLflow's log lines on first use).
    shown_out = captured.out.splitlines()
    shown_err = [line for line in captured.err.splitlines() if line.startswith("[rank ")]
    for rank in (0, 1):
        prefix = f"[rank {rank}] "
        assert [line.removeprefix(prefix) for line in shown_out if line.startswith(prefix)] == [
            *(f"line {i} of rank {rank}" for i in range(n)),
            f"raw write from rank {rank}",
            f"C printf from rank {rank}",
            "progress 100%",
            "no newline at the end",
        ]
        assert [line.removeprefix(prefix) for line in shown_err if line.startswith(prefix)] == [
            f"to stderr from rank {rank}"
        ]
    assert len(shown_out) == 2 * (n + 4) and len(shown_err) == 2  # nothing else, nothing twice


def test_wrong_call_fails_before_launch():
    before = air_magic.last_run()
    fn = distributed(display="none")(_all_reduce)
    with pytest.raises(TypeError, match="offset"):
        fn.distributed()
    with pytest.raises(TypeError):
        fn.distributed(1, 2)
    assert air_magic.last_run() is before


def test_with_overrides_changes_the_rank_count():
    base = distributed(num_accelerators=2, display="none")(_rank_facts)
    assert len(base.with_overrides(num_accelerators=4).distributed()) == 4
    assert len(base.distributed()) == 2


def _run_dir_modes():
    import os
    import stat

    call_dir = os.environ["AIR_MAGIC_RUN_DIR"]
    files = {
        name: oct(stat.S_IMODE(os.stat(os.path.join(call_dir, name)).st_mode))
        for name in os.listdir(call_dir)
    }
    return oct(stat.S_IMODE(os.stat(call_dir).st_mode)), files


def test_run_directory_is_private():
    (dir_mode, files), _ = distributed(num_accelerators=2, display="none")(_run_dir_modes).distributed()
    assert dir_mode == "0o700"
    # payload.pkl may already be gone: it is deleted once every rank has read it.
    assert files["launch.json"] == "0o600" and set(files.values()) == {"0o600"}
    # The autouse fixture checks that it is gone afterwards.


def _quiet():
    return 1


def test_cpu_mode_is_said_once_per_process(monkeypatch, capsys):
    from air_magic.display import text as text_display

    monkeypatch.setattr(text_display, "_cpu_mode_said", False)
    fn = distributed(num_accelerators=2, display="text")(_quiet)
    fn.distributed()
    fn.distributed()
    assert capsys.readouterr().err.count("CPU mode") == 1


def test_a_broken_display_never_breaks_the_run(capsys):
    from air_magic.backends.local.backend import LocalBackend
    from air_magic.calls.history import RunHistory
    from air_magic.launch.accelerators import plan_accelerators
    from air_magic.launch.request import LaunchRequest
    from air_magic.protocol.events import EventBus, RankOutput
    from air_magic.protocol.serialization import dumps

    class Broken:
        def handle(self, event):
            if isinstance(event, RankOutput):
                raise RuntimeError("display bug")

    history = RunHistory()
    request = LaunchRequest(
        name="chatty", payload=dumps((_chatty, (10,), {}, {})), plan=plan_accelerators(2, None), timeout=60
    )
    result = LocalBackend().run(request, EventBus([Broken(), history]))
    assert result.unwrap() == ["0", "1"]
    assert "output consumer Broken failed and was detached" in capsys.readouterr().err
    assert air_magic.last_run().outcome == "succeeded"


def test_the_quickstart_example_trains_one_model(tmp_path):
    import subprocess

    example = str(EXAMPLES / "quickstart.py")
    done = subprocess.run([sys.executable, example], capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr
    assert "[rank 0] epoch 5/5" in done.stdout and "OK: 2 ranks trained one model" in done.stdout


def test_a_call_stopped_while_starting_is_listed_with_its_outcome(tmp_path, monkeypatch):
    import json

    from air_magic.calls import history

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # as Ctrl-C lands while the store imports torch

    monkeypatch.setattr("air_magic.backends.local.local_call.RendezvousStore", interrupted)
    fn = distributed(num_accelerators=2, display="none", tracking=False, log_dir=str(tmp_path))(lambda: 1)
    with pytest.raises(KeyboardInterrupt):
        fn.distributed()
    (summary,) = history.read_summaries(str(tmp_path))
    assert summary["outcome"] == "interrupted" and summary["world_size"] == 2
    assert summary["name"].endswith("<lambda>")
    assert json.loads(Path(summary["log_dir"], "run.json").read_text())["outcome"] == "interrupted"


def test_a_deleted_working_folder_is_said_before_launch(tmp_path):
    import subprocess

    gone = tmp_path / "gone"
    gone.mkdir()
    code = (
        "import os, air_magic\nos.chdir(os.environ['GONE'])\nos.rmdir(os.environ['GONE'])\n"
        "try:\n    air_magic.distributed(num_accelerators=2, display='none', tracking=False)(lambda: 1)"
        ".distributed()\nexcept air_magic.ConfigurationError as exc:\n    print('refused:', exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "GONE": str(gone)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "refused: <lambda>: this process's working folder no longer exists" in done.stdout, done.stderr
    assert "MKL" not in done.stderr


def test_a_caller_holding_1200_open_files_launches_warm_and_fresh(tmp_path):
    """A kernel with a data loader and many sockets: descriptors numbered past 1,023 (select()'s
    ceiling) work, and a soft open-file limit too small for the ranks is raised, as far as needed."""
    import resource
    import subprocess

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2000:
        pytest.skip("the hard open-file limit here is below 2,000")
    code = (
        "import os, resource, air_magic\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (1300, hard))\n"
        "held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1200)]\n"
        "assert max(held) > 1200\n"
        "for warm in (True, False):\n"
        "    fn = air_magic.distributed(num_accelerators=4, display='none', tracking=False,\n"
        "                               warm_start=warm, log_dir=os.environ['LOGS'])(lambda: os.getpid())\n"
        "    print('ranks', warm, len(set(fn.distributed())), flush=True)\n"
        "print('limit', resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "LOGS": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "ranks True 4" in done.stdout and "ranks False 4" in done.stdout
    assert int(done.stdout.split("limit ")[1]) > 1300  # raised for the ranks' pipes, pidfds and logs


def test_a_store_host_that_fails_leaves_nothing_and_the_caller_serves_the_store():
    from air_magic.node import warm
    from air_magic.node.rendezvous import RendezvousStore

    starter = warm.get_starter(wait_s=120)
    assert starter is not None
    store = RendezvousStore(2, serve=False)
    try:
        store.timeout_s = float("inf")  # the host cannot make it (timedelta overflows): it exits
        assert not store.serve_in(starter)
        store.timeout_s = 60.0
        store.serve_here()  # the listener was still ours
        import torch.distributed as dist

        client = dist.TCPStore("127.0.0.1", store.port, 2, False, wait_for_workers=False)
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        store.close()
    hosted = RendezvousStore(2, serve=False)
    try:
        assert hosted.serve_in(starter)
        import torch.distributed as dist

        client = dist.TCPStore("127.0.0.1", hosted.port, 2, False, wait_for_workers=False)
        client.set("k", "w")
        assert client.get("k") == b"w"
    finally:
        hosted.close()  # its host ends (no_leftovers checks)


def test_a_scripts_decorated_function_saves_a_whole_model_of_the_scripts_class(tmp_path):
    """``torch.save(Net())`` of the script's own class in a ``@distributed`` function (issue 48 item 1)."""
    import subprocess

    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys\n"
        "import torch\n"
        "from air_magic import distributed\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.layer = torch.nn.Linear(2, 1)\n"
        "@distributed(num_accelerators=2, display='none', tracking=False)\n"
        "def train(out):\n"
        "    path = os.path.join(out, f\"net-{os.environ['RANK']}.pt\")\n"
        "    torch.save(Net(), path)\n"
        "    return type(torch.load(path, weights_only=False)).__name__\n"
        "if __name__ == '__main__':\n"
        "    print(train.distributed(sys.argv[1]))\n"
    )
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "['Net', 'Net']" in done.stdout
