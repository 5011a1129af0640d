"""Detached runs on Ray as Ray jobs (issue 35): submitted, then followed from a process with no state.

A real Ray head with its dashboard on 127.0.0.1 (``ray start --head --block`` in a
process group of its own, stopped by that group at the module's end). The submitter
and the followers are ``air-magic`` processes; a follower's HOME and state folder are
empty, so all it knows comes from the cluster (``RAY_ADDRESS``: the dashboard).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from helpers.cli import command, environment
from helpers.modules import skip_unless_installed
from helpers.ray_head import start_head, stop_head

import air_magic
from air_magic.errors import LaunchError, RankFailedError

pytestmark = [skip_unless_installed("ray", "aiohttp_cors"), pytest.mark.timeout(300)]
fault = pytest.mark.fault

HEAD: dict[str, str] = {}  # the running head's Ray Client address ("client": ray://...) and "temp" folder


@pytest.fixture(scope="module")
def head():
    """The dashboard's address of a loopback Ray head of 8 CPUs, stopped (every process of it) after."""
    started = start_head(num_cpus=8)
    HEAD.update(client=started.client, temp=started.temp)
    try:
        yield started.address
    finally:
        stop_head(started)


@pytest.fixture
def submitted(head):
    """The runs a test submits; each is stopped at its end, whatever happened."""
    runs: list[str] = []
    yield runs
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(head)
    for run_id in runs:
        client.stop_job(run_id)
    for run_id in runs:
        deadline = time.monotonic() + 60
        while str(client.get_job_status(run_id)) in ("PENDING", "RUNNING") and time.monotonic() < deadline:
            time.sleep(0.2)


def _elsewhere(tmp_path, address: str) -> dict[str, str]:
    """A follower's environment: nothing of this machine's air_magic state, the cluster's address."""
    home = tmp_path / "elsewhere"
    home.mkdir(exist_ok=True)
    env = environment()
    env.update(HOME=str(home), XDG_STATE_HOME=str(home / "state"), RAY_ADDRESS=address)
    env.pop("AIR_MAGIC_LOG_DIR", None)
    return env


def _air_magic(
    *args: str, env: dict[str, str], cwd=None, timeout: float = 180
) -> subprocess.CompletedProcess:
    started = time.monotonic()
    done = subprocess.run(
        [*command(), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    print(f"air-magic {args[0]}: {time.monotonic() - started:.1f} s")
    return done


def _project(tmp_path) -> str:
    project = tmp_path / "project"
    project.mkdir()
    (project / "helper_lib.py").write_text("def scale(x):\n    return 10 * x\n")
    (project / "train.py").write_text(
        textwrap.dedent(
            """
            import os, sys, time
            from helper_lib import scale  # beside the script: the working folder travelled

            rank = int(os.environ["RANK"])
            print(f"rank {rank} of {os.environ['WORLD_SIZE']} says {scale(rank)}", flush=True)
            if "--wait" in sys.argv:
                gate = sys.argv[-1]
                with open(f"{gate}.{rank}.pid", "w") as f:
                    f.write(str(os.getpid()))
                print(f"rank {rank} waits", flush=True)
                while not os.path.exists(gate):
                    time.sleep(0.1)
            if "--fail" in sys.argv and rank == 1:
                raise ValueError("rank 1 hit a bad batch")
            print(f"rank {rank} done", flush=True)
            """
        )
    )
    return str(project)


def _submit(project: str, address: str, *script_args: str, runs: list[str]) -> str:
    env = environment()
    # Set for notebook calls (Ray Client): the address given to the detached run wins over it.
    env["RAY_ADDRESS"] = HEAD["client"]
    started = time.monotonic()
    done = _air_magic(
        "run",
        "--no-tracking",
        "--cluster",
        f"ray={address}",
        "--detach",
        "-n",
        "2",
        "train.py",
        *script_args,
        env=env,
        cwd=project,
    )
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"detached run (\S+) started", done.stdout)
    assert found, done.stdout
    runs.append(found.group(1))
    print(f"submitted in {took:.1f} s")
    return found.group(1)


SUBMIT_AND_DIE = """
import os, signal, sys
import air_magic

def train():
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 hit a bad batch")

on_ray = air_magic.distributed(
    num_accelerators=2, display="none", tracking=False, detach=True, cluster="ray=" + sys.argv[1]
)
handle = on_ray(train).distributed_async()  # back once Ray accepted it; a thread follows it here
print("submitted", handle.detached_id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _submit_and_die(tmp_path, address: str, runs: list[str]) -> str:
    """A run submitted through the Python API by a process SIGKILLed right after (a kernel that
    died): the run is the cluster's; nothing of it was in that process."""
    script = tmp_path / "submit_and_die.py"
    script.write_text(SUBMIT_AND_DIE)
    env = environment()
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, str(script), address], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr[-3000:]
    (run_id,) = re.findall(r"^submitted (\S+)$", done.stdout, re.M)
    runs.append(run_id)
    return run_id


def _job_status(address: str, run_id: str) -> str:
    from ray.job_submission import JobSubmissionClient

    return str(JobSubmissionClient(address).get_job_status(run_id))


@fault(
    "the submitter exits right after submitting detached runs to Ray (one succeeds; one, whose submitter "
    "is SIGKILLed as its follower starts, has a rank that fails)",
    "the jobs run on; a process with no local state lists them, attaches (the whole output; exit 0, "
    "or the rank's own traceback and exit 1) and reads a rank's log",
)
def test_runs_submitted_to_ray_are_followed_from_a_process_with_no_state(head, tmp_path, submitted):
    project = _project(tmp_path)
    run_id = _submit(project, head, runs=submitted)  # the submitting process has exited
    failing = _submit_and_die(tmp_path, head, runs=submitted)  # SIGKILLed as its follower starts
    env = _elsewhere(tmp_path, head)
    attached = _air_magic("attach", run_id, env=env)
    assert attached.returncode == 0, attached.stdout[-2000:] + attached.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} of 2 says {10 * rank}" in attached.stdout  # its helper module came along
        assert f"rank {rank} done" in attached.stdout
    attached = _air_magic("attach", failing, env=env)
    assert attached.returncode == 1, attached.stdout[-2000:] + attached.stderr[-3000:]
    assert "ValueError: rank 1 hit a bad batch" in attached.stderr
    listed = {r.id: r for r in air_magic.runs(cluster=f"ray={head}")}  # air-magic runs' own list
    assert (listed[run_id].status, listed[run_id].world_size, listed[run_id].name) == (
        "succeeded",
        2,
        "train.py",
    )
    assert listed[failing].status == "failed" and listed[failing].cluster == head
    log = _air_magic("logs", run_id, "1", env=env)
    assert log.returncode == 0 and "rank 1 done" in log.stdout, log.stderr


@fault(
    "cancel of a detached run on Ray from another machine; another run's supervisor SIGKILLed",
    "the cancelled job STOPPED, every rank gone, its follower ends 'stopped'; the other's ranks stop "
    "with it, its follower and runs() say it was lost",
)
def test_cancel_stops_a_ray_job_and_a_killed_supervisor_takes_its_ranks(head, tmp_path, submitted):
    project = _project(tmp_path)
    gates = {"cancelled": tmp_path / "gate-a", "killed": tmp_path / "gate-b"}
    runs = {how: _submit(project, head, "--wait", str(gate), runs=submitted) for how, gate in gates.items()}
    env = _elsewhere(tmp_path, head)
    followers = [  # two at once, each with the whole story
        subprocess.Popen(
            [*command(), "attach", runs["cancelled"]],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    ranks = {how: _wait_for_ranks(gate) for how, gate in gates.items()}
    # The second followed from this process through the Python API (a kernel's way), the cluster named.
    handle = air_magic.attach(runs["killed"], display="none", cluster=f"ray={head}")
    assert sorted(handle.rank_pids) == [0, 1] and handle.status == "running"
    assert "rank 1 waits" in handle.logs(1)  # read from the job's node
    dump = handle.stacks()  # taken on the ranks' node by a helper job
    assert sorted(dump) == [0, 1] and all("train.py" in dump[rank] for rank in (0, 1)), dump
    from ray.job_submission import JobSubmissionClient

    helpers = [
        j.submission_id for j in JobSubmissionClient(head).list_jobs() if "-stacks-" in j.submission_id
    ]
    assert helpers == [], helpers  # each helper job is deleted once read
    shown = _air_magic("stack", runs["cancelled"], "0", env=env)
    assert shown.returncode == 0 and "  rank 0:" in shown.stdout and "train.py" in shown.stdout, shown
    assert "  rank 1:" not in shown.stdout

    cancelled = _air_magic("cancel", runs["cancelled"], env=env)
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout, cancelled.stdout + cancelled.stderr
    (supervisor,) = [
        p
        for p in psutil.process_iter(["cmdline"])
        if f"--ray-job {runs['killed']}" in " ".join(p.info["cmdline"] or ())
    ]
    supervisor.kill()
    _wait_gone(ranks["cancelled"])
    _wait_gone(ranks["killed"], seconds=60)  # its agents went with it (they were the job's actors)
    for follower in followers:
        out, err = follower.communicate(timeout=120)
        assert follower.returncode != 0 and "stopped before it finished" in err, out[-2000:] + err[-2000:]
        assert "rank 0 of 2 says 0" in out and "rank 1 waits" in out, out[-2000:]
    with pytest.raises(LaunchError, match="without a result"):
        handle.result(timeout=60)
    deadline = time.monotonic() + 60  # Ray says STOPPED once the supervisor has ended its run and exited
    while _job_status(head, runs["cancelled"]) != "STOPPED":
        assert time.monotonic() < deadline, _job_status(head, runs["cancelled"])
        time.sleep(0.5)
    listed = {r.id: r.status for r in air_magic.runs(cluster=f"ray={head}")}
    assert (listed[runs["cancelled"]], listed[runs["killed"]]) == ("cancelled", "lost")


def _wait_for_ranks(gate, count: int = 2, seconds: float = 120) -> list[psutil.Process]:
    """The rank processes of a job run, once ``count`` of them wait at the gate."""
    deadline = time.monotonic() + seconds
    paths = [Path(f"{gate}.{rank}.pid") for rank in range(count)]
    while not all(p.exists() and p.read_text() for p in paths):
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.2)
    return [psutil.Process(int(p.read_text())) for p in paths]


def _wait_gone(procs: list[psutil.Process], seconds: float = 30) -> None:
    _, alive = psutil.wait_procs(procs, timeout=seconds)
    assert not alive, f"ranks still alive: {alive}"


@fault(
    "cancel of a detached run on Ray at once, while its job is still starting (PENDING here: Ray "
    "still sets up its runtime environment)",
    "the run ends cancelled, nothing of it runs on; the job STOPPED, runs() says cancelled",
)
def test_a_cancel_while_the_job_is_starting_ends_it_cancelled(head, submitted):
    sleeps = air_magic.distributed(
        num_accelerators=2, display="none", tracking=False, detach=True, cluster=f"ray={head}"
    )(lambda: __import__("time").sleep(600))
    handle = sleeps.distributed_async()  # back once Ray accepted the job
    submitted.append(handle.detached_id)
    when = _job_status(head, handle.detached_id)
    assert handle.cancel() is True, handle.status
    print(f"cancelled while {when}")  # PENDING in every run so far (its runtime environment takes ~2 s)
    assert handle.status == "cancelled"
    with pytest.raises(LaunchError, match=r"cancelled before its ranks started|stopped before it finished"):
        handle.result()
    deadline = time.monotonic() + 60
    while _job_status(head, handle.detached_id) != "STOPPED":
        assert time.monotonic() < deadline, _job_status(head, handle.detached_id)
        time.sleep(0.5)
    listed = {r.id: r.status for r in air_magic.runs(cluster=f"ray={head}")}
    assert listed[handle.detached_id] == "cancelled"


RAY_CLIENT_SCRIPT = """
import os, sys
import air_magic
from air_magic.errors import ConfigurationError

address = sys.argv[1]
air_magic.ray_init(address)

@air_magic.distributed(num_accelerators=2, cluster="ray=" + address, display="text", tracking=False)
def breaks():
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 broke over Ray Client")
    import time
    time.sleep(30)

try:
    breaks.distributed()
except ValueError as exc:
    print("raised:", exc)

@air_magic.ray_launch(num_accelerators=1, display="text", tracking=False)
def driver():  # its ray.init() would join through RAY_ADDRESS (a second ray:// connection: seconds)
    return os.environ["RAY_ADDRESS"]

print("driver returned", driver.distributed())
for detached in ({"cluster": "ray=" + address}, {"cluster": "ray"}):
    try:
        air_magic.distributed(num_accelerators=2, detach=True, **detached)(len).distributed_async([])
    except ConfigurationError as exc:
        print("refused:", exc)
"""


def test_ray_client_addresses_work_for_calls_and_ray_launch_and_are_refused_for_jobs(head, tmp_path):
    """ray:// (item 4): ray_init, a call (a failing rank's own traceback) and a ray_launch driver
    (given the same ray:// address to join through) work; a detached run asks for the dashboard's."""
    address = HEAD["client"]
    script = tmp_path / "client.py"
    script.write_text(RAY_CLIENT_SCRIPT)
    env = environment()
    env.update(RAY_ADDRESS=address, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    done = subprocess.run(
        [sys.executable, str(script), address], env=env, capture_output=True, text=True, timeout=240
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:] + _client_server_logs()
    assert f"connected to Ray at {address}" in out
    print(*[line for line in out.splitlines() if "trying again" in line], sep="\n")  # Ray's flake, retried
    line = 1 + RAY_CLIENT_SCRIPT.splitlines().index(
        '        raise ValueError("rank 1 broke over Ray Client")'
    )
    assert "raised: rank 1 broke over Ray Client" in out and f"line {line}, in breaks" in out, out[-4000:]
    assert f"driver returned ['{address}']" in out, out[-4000:]
    refusals = [line for line in out.splitlines() if line.startswith("refused:")]
    assert len(refusals) == 2 and all("dashboard address" in line for line in refusals), out[-3000:]


@fault(
    "ray_init and a detached run given a loopback-only head's GCS address (127.0.0.1:PORT)",
    "both connect (Ray's rewrite of 127.0.0.1 kept off); a head that does not answer: one error "
    "within the bound",
)
def test_a_loopback_heads_gcs_address_connects_and_a_dead_one_fails_in_time(head, tmp_path, submitted):
    """Issue 48 item 4: Ray rewrote 127.0.0.1 to the host's address and retried without end."""
    (port_file,) = Path(HEAD["temp"], "session_latest").glob("gcs_server_port_*")
    gcs = f"127.0.0.1:{port_file.read_text().strip()}"
    env = {k: v for k, v in environment().items() if not k.startswith("RAY_")}  # as a user's shell
    connect = f"import air_magic\ninfo = air_magic.ray_init({gcs!r})\nprint('NODES', info.nodes)"
    done = subprocess.run(
        [sys.executable, "-c", connect], env=env, capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0 and "NODES 1" in done.stdout, done.stderr[-3000:]
    started = time.monotonic()
    dead = "import air_magic\nair_magic.ray_init('127.0.0.1:1')"
    env_short = {**env, "AIR_MAGIC_RAY_INIT_TIMEOUT": "5"}
    done = subprocess.run(
        [sys.executable, "-c", dead], env=env_short, capture_output=True, text=True, timeout=90
    )
    assert (
        done.returncode != 0
        and "could not connect to the Ray cluster at 127.0.0.1:1 within 5 s" in done.stderr
    )
    assert time.monotonic() - started < 45
    project = _project(tmp_path)
    done = _air_magic(
        "run", "--no-tracking", "--cluster", f"ray={gcs}", "--detach", "-n", "2", "train.py",
        env=env, cwd=project, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"detached run (\S+) started", done.stdout)
    assert found, done.stdout
    submitted.append(found.group(1))


@fault(
    "a node of a detached run on Ray is lost mid-run (its processes SIGKILLed)",
    "the job's call fails naming the lost node; the follower elsewhere gets that error; its ranks are gone",
)
def test_a_node_lost_under_a_ray_job_fails_its_run_naming_the_node(head, tmp_path, submitted):
    """Last in this module: the worker node it adds (two fake GPUs, so the run's two ranks go there)
    is gone at its end."""
    (port_file,) = Path(HEAD["temp"], "session_latest").glob("gcs_server_port_*")  # the head's GCS
    gcs = f"127.0.0.1:{port_file.read_text().strip()}"
    node = subprocess.Popen(
        [sys.executable, str(Path(__file__).parents[1] / "helpers" / "ray_worker_node.py"), gcs, "2", "2"],
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        said = [node.stdout.readline()]  # Ray's own lines first; it ends if the node cannot join
        while said[-1] and not said[-1].startswith("ready"):
            said.append(node.stdout.readline())
        assert said[-1].startswith("ready"), "".join(said[-30:])
        gate = tmp_path / "gate"

        def waits_at(gate):  # defined here: pickled by value (the cluster cannot import this module)
            import os
            import time

            with open(f"{gate}.{os.environ['RANK']}.pid", "w") as f:
                f.write(str(os.getpid()))
            while not os.path.exists(gate):
                time.sleep(0.1)

        waits = air_magic.distributed(
            num_accelerators=2, display="none", tracking=False, detach=True, cluster=f"ray={head}"
        )(waits_at)
        handle = waits.distributed_async(str(gate))  # a function: no working folder (see below)
        submitted.append(handle.detached_id)
        ranks = _wait_for_ranks(gate)
        assert handle.status == "running"
    finally:
        # Both nodes share this machine and the head's session folder, so a script's working folder
        # would be unpacked there twice (Ray then removes the job's current folder): one reason this
        # run is a function. The node's processes all die at once, as with a lost machine.
        os.killpg(node.pid, signal.SIGKILL)
        node.wait()
    with pytest.raises(RankFailedError, match="was lost during the call") as caught:
        handle.result(timeout=120)
    print(caught.value)
    said = str(caught.value)
    assert "(node 0) was lost during the call" in said and "rank(s) 0, 1" in said, said
    _wait_gone(ranks)
    listed = {r.id: r.status for r in air_magic.runs(cluster=f"ray={head}")}
    assert listed[handle.detached_id] == "failed"


def _client_server_logs() -> str:
    """The head's Ray Client servers' own logs (why one did not start), for a failure's message."""
    logs = Path(HEAD["temp"], "session_latest", "logs")
    said = [
        f"\n== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
        for p in sorted(logs.glob("ray_client_server*"))
    ]
    return "".join(said)
