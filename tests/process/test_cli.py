"""``air-magic run`` as a user runs it: a subprocess, real ranks, its output and exit status (issue 17).

Each test starts the command line as its own process (a fresh caller, so a
cold start: the warm starter is that process's own), in a folder of small
scripts. ``--json`` gives the ranks' pids, so the signal tests can check that
no rank outlives the command.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from helpers.cli import command, environment, invoke

DDP_SCRIPT = """
import os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # torchrun's variables: nothing else is set up
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} argv={sys.argv[1:]} sum={t.item():g}")
dist.destroy_process_group()
"""

ENDINGS = """
import os, sys, time
rank = int(os.environ["RANK"])
how = sys.argv[1]
if how == "raise" and rank == 1:
    raise ValueError("rank 1 cannot go on")
if how == "kill" and rank == 1:
    os.kill(os.getpid(), 9)
if how == "exit3" and rank == 0:
    sys.exit(3)
if how == "exit0":
    sys.exit(0)
if how == "sleep":
    print("sleeping", flush=True)
    time.sleep(600)
"""

FUNCTIONS = """
import asyncio
import os

def whoami(*args):
    return {"rank": int(os.environ["RANK"]), "args": list(args)}

async def waits(seconds):
    await asyncio.sleep(float(seconds))
    return int(os.environ["RANK"])
"""


@pytest.fixture
def project(tmp_path):
    (tmp_path / "ddp.py").write_text(DDP_SCRIPT)
    (tmp_path / "endings.py").write_text(ENDINGS)
    (tmp_path / "helpers.py").write_text(FUNCTIONS)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "job.py").write_text(
        "import os, sys\nprint('module', os.environ['RANK'], sys.argv[1:])\n"
    )
    return tmp_path


def air_magic(project, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``air-magic run --no-tracking ARGS`` in the project's folder."""
    return invoke("run", "--no-tracking", *args, cwd=project, timeout=timeout)


def test_a_torchrun_script_runs_unchanged_with_its_arguments(project):
    done = air_magic(project, "ddp.py", "--lr", "0.1", "extra")
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank} of 2 argv=['--lr', '0.1', 'extra'] sum=3" in done.stdout
    assert "\x1b[" not in done.stdout  # piped: no colour


def test_a_function_target_prints_every_ranks_return_value(project):
    done = air_magic(project, "helpers:whoami", "a", "b")
    assert done.returncode == 0, done.stderr
    assert "rank 0: {'rank': 0, 'args': ['a', 'b']}" in done.stdout
    assert "rank 1: {'rank': 1, 'args': ['a', 'b']}" in done.stdout


def test_a_module_target_runs_as_python_dash_m(project):
    done = air_magic(project, "-n", "3", "-m", "pkg.job", "--flag")
    assert done.returncode == 0, done.stderr
    for rank in range(3):
        assert f"[rank {rank}] module {rank} ['--flag']" in done.stdout


@pytest.mark.parametrize(
    ("how", "status", "said"),
    [
        ("raise", 1, "ValueError: rank 1 cannot go on"),
        ("kill", 128 + 9, "SIGKILL"),
        ("exit3", 3, "exited with status 3"),
        ("exit0", 0, ""),
    ],
)
def test_the_exit_status_is_the_root_cause_ranks(project, how, status, said):
    done = air_magic(project, "endings.py", how)
    assert done.returncode == status, done.stderr
    assert said in done.stderr
    if how == "raise":  # the rank's own traceback, with the script's line
        assert 'endings.py", line 6' in done.stderr and "cli.py" not in done.stderr


def test_a_timeout_exits_124(project):
    done = air_magic(project, "--timeout", "3", "endings.py", "sleep")
    assert done.returncode == 124, done.stderr
    assert "DistributedTimeoutError" in done.stderr


def _started_ranks(proc: subprocess.Popen[str], count: int) -> list[int]:
    pids = []
    assert proc.stdout is not None
    for line in proc.stdout:
        event = json.loads(line)
        if event["event"] == "rank_started":
            pids.append(event["pid"])
        if event["event"] == "line" and event["text"] == "sleeping":
            count -= 1
            if count == 0:
                return pids
    raise AssertionError("the ranks did not start")


def _as_a_background_job() -> None:
    # A script's `command &` starts with SIGINT ignored, and Python keeps it so: the command
    # must stop its ranks on SIGINT all the same.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(
    ("sent", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)]
)
def test_a_signal_to_the_command_stops_every_rank(project, sent, status):
    proc = subprocess.Popen(
        [*command(), "run", "--no-tracking", "--json", "endings.py", "sleep"],
        cwd=project,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_as_a_background_job,
    )
    try:
        pids = _started_ranks(proc, 2)
        proc.send_signal(sent)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == status
    result = json.loads(out.splitlines()[-1])
    assert result["event"] == "result" and result["exit_status"] == status
    deadline = time.monotonic() + 10
    while any(
        psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids
    ):
        assert time.monotonic() < deadline, "a rank outlived the command"
        time.sleep(0.05)


def test_json_is_one_object_per_line_from_start_to_result(project):
    done = air_magic(project, "--json", "ddp.py", "x")
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "run_started" and kinds[-2:] == ["run_finished", "result"]
    assert kinds.count("rank_started") == 2 and kinds.count("rank_exited") == 2
    lines = sorted(e["text"] for e in events if e["event"] == "line")
    assert lines == [f"rank {r} of 2 argv=['x'] sum=3" for r in (0, 1)]
    assert events[-1]["exit_status"] == 0 and events[-1]["values"] == [None, None]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["nothere.py"], "no such script: nothere.py"),
        (["-m", "no_such_module"], "no module named 'no_such_module'"),
        (["helpers"], "is not a file"),
        (["helpers:missing"], "module 'helpers' "),
        (["-n", "zero", "ddp.py"], "-n/--num-accelerators"),
        (["--timeout", "soon", "ddp.py"], "--timeout"),
        ([], "needs a TARGET"),
    ],
)
def test_a_bad_target_or_option_is_one_line_and_exit_status_2(project, args, said):
    done = air_magic(project, *args, timeout=60)
    assert done.returncode == 2
    assert said in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def _notebook(path, *cells: str) -> None:
    cell = {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None}
    book = {
        "cells": [{**cell, "source": c} for c in cells],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(book))


def test_a_notebook_runs_its_cells_in_order_distributed_ones_on_the_ranks(project):
    pytest.importorskip("IPython")
    _notebook(
        project / "book.ipynb",
        "greeting = 'from the caller'\nprint(greeting)",
        "%%distributed -n 2 --no-tracking --display text\nimport os\nprint('on rank', os.environ['RANK'])",
        "print('after the cell:', greeting)",
    )
    _notebook(
        project / "broken.ipynb",
        "%%distributed -n 2 --no-tracking --display text\nraise KeyError('missing')",
        "print('never')",
    )
    done = invoke("run", "book.ipynb", cwd=project)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.index("from the caller") < out.index("[rank 0] on rank 0") < out.index("after the cell:")
    assert "[rank 1] on rank 1" in out
    broken = invoke("run", "broken.ipynb", cwd=project)
    assert broken.returncode == 1
    assert "KeyError" in broken.stdout + broken.stderr and "never" not in broken.stdout
    assert "cell 1 of broken.ipynb failed" in broken.stderr


def test_python_dash_m_air_magic_is_the_same_command(project):
    done = invoke(
        "run", "--no-tracking", "helpers:whoami", cwd=project, program=[sys.executable, "-m", "air_magic"]
    )
    assert done.returncode == 0, done.stderr
    assert "rank 1: {'rank': 1, 'args': []}" in done.stdout


def test_the_tracked_run_is_named_at_the_end(project, store):
    done = invoke("run", "--experiment", "cli", "helpers:whoami", cwd=project)
    assert done.returncode == 0, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("air-magic: MLflow run ") and "experiment" in last
    (run,) = store.search_runs([store.get_experiment_by_name("cli").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["function"] == "helpers:whoami"
    assert run.data.tags["air_magic.kind"] == "function"


def test_runs_lists_the_calls_and_logs_prints_a_ranks_log(project, tmp_path):
    logs = tmp_path / "logs"
    assert air_magic(project, "--log-dir", str(logs), "ddp.py", "first").returncode == 0
    assert air_magic(project, "--log-dir", str(logs), "endings.py", "raise").returncode == 1
    listed = invoke("runs", "--log-dir", str(logs))
    assert listed.returncode == 0, listed.stderr
    newest, oldest = listed.stdout.strip().splitlines()
    assert " failed " in newest and "endings.py" in newest
    assert " succeeded " in oldest and "ddp.py" in oldest
    first_id = oldest.split()[0]
    shown = invoke("logs", "--log-dir", str(logs), first_id, "1")
    assert shown.returncode == 0 and "rank 1 of 2 argv=['first'] sum=3" in shown.stdout
    missing = invoke("logs", "--log-dir", str(logs), "no-such-run")
    assert missing.returncode == 2 and "no call 'no-such-run'" in missing.stderr


def _gated_script(tmp_path, name: str, end: str = ""):
    """A script whose ranks print 'before', wait for the gate file, print 'after' (then ``end``)."""
    gate = tmp_path / "gate"
    script = tmp_path / name
    script.write_text(
        "import os, sys, time\n"
        "print('rank', os.environ['RANK'], 'before', flush=True)\n"
        f"while not os.path.exists({str(gate)!r}):\n"
        "    time.sleep(0.02)\n"
        "print('rank', os.environ['RANK'], 'after', flush=True)\n" + end
    )
    return script, gate


def test_run_detach_returns_at_once_and_attach_follows_to_the_exit_status(project, tmp_path):
    script, gate = _gated_script(tmp_path, "waits.py", "sys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    started = air_magic(project, "--detach", "-n", "2", str(script))
    assert started.returncode == 0, started.stderr
    run_id = started.stdout.split("detached run ")[1].split()[0]
    assert f"air-magic attach {run_id}" in started.stdout
    listed = invoke("runs", cwd=project)
    assert run_id in listed.stdout
    follower = subprocess.Popen(
        [*command(), "attach", run_id[:15]],
        cwd=project,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not all("before" in invoke("logs", run_id, str(rank), cwd=project).stdout for rank in (0, 1)):
        assert time.monotonic() < deadline, "the ranks did not start"  # (rank 1's exit 3 stops rank 0)
        time.sleep(0.2)
    gate.touch()
    out, err = follower.communicate(timeout=120)
    assert follower.returncode == 3, err  # the failing rank's own exit status
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank} before" in out and f"[rank {rank}] rank {rank} after" in out
    assert invoke("attach", "no-such-run", cwd=project).returncode == 2


def test_cancel_stops_a_detached_run(project, tmp_path):
    script = tmp_path / "forever.py"
    script.write_text("import time\nwhile True:\n    time.sleep(0.1)\n")
    started = air_magic(project, "--detach", "-n", "2", str(script))
    run_id = started.stdout.split("detached run ")[1].split()[0]
    cancelled = invoke("cancel", run_id, cwd=project)
    assert cancelled.returncode == 0 and "cancelled; every rank is gone" in cancelled.stdout, cancelled.stderr
    row = invoke("runs", cwd=project).stdout.split(run_id)[1].splitlines()[0]
    assert "cancelled" in row, row


def _in_a_mount_namespace() -> list[str] | None:
    """How to run a shell in a mount namespace of its own (a tmpfs mounted there is seen by it
    alone, and gone with it); None where this machine allows neither way."""
    for prefix in (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"]):
        try:
            tried = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if tried.returncode == 0:
            return prefix
    return None


@pytest.mark.fault(
    "the log folder's disk fills up while ranks print (a 256 KiB tmpfs, 2 x 20 000 lines)",
    "one line per rank says its log is cut short; every line is still shown; the call succeeds; "
    "run.json and `air-magic runs` say succeeded",
)
def test_a_full_log_disk_cuts_the_log_and_nothing_else(project, tmp_path):
    namespace = _in_a_mount_namespace()
    if namespace is None:
        pytest.skip("neither `unshare --mount` nor a user namespace is allowed here")
    (project / "chatty.py").write_text(
        "import os\nrank = os.environ['RANK']\nfor i in range(20000):\n    print(f'rank {rank} line {i}')\n"
    )
    logs = tmp_path / "small-disk"
    logs.mkdir(mode=0o700)
    program = " ".join(command())
    shell = (
        f"mount -t tmpfs -o size=256k,mode=0700 tmpfs {logs} || exit 99\n"
        f"{program} run --no-tracking --log-dir {logs} -n 2 chatty.py > {tmp_path}/out 2> {tmp_path}/err\n"
        f"echo $? > {tmp_path}/status\n"
        f"{program} runs --log-dir {logs} > {tmp_path}/runs 2>&1\n"
        f"cat {logs}/*/run.json > {tmp_path}/summary\n"
    )
    done = subprocess.run(
        [*namespace, "sh", "-c", shell], cwd=project, env=environment(), capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    err = (tmp_path / "err").read_text()
    assert (tmp_path / "status").read_text().strip() == "0", err
    out = (tmp_path / "out").read_text().splitlines()
    for rank in (0, 1):
        shown = [line for line in out if line.startswith(f"[rank {rank}] rank {rank} line ")]
        assert shown == [f"[rank {rank}] rank {rank} line {i}" for i in range(20000)], rank
    cut = [line for line in err.splitlines() if "is cut short here (No space left on device)" in line]
    assert 1 <= len(cut) <= 2, err  # once per rank whose log hit the end of the disk
    assert "Traceback" not in err and "OSError" not in err, err
    assert json.loads((tmp_path / "summary").read_text())["outcome"] == "succeeded"
    assert "succeeded" in (tmp_path / "runs").read_text()


def test_a_notebook_run_waits_for_the_background_runs_it_started(project):
    pytest.importorskip("IPython")
    _notebook(
        project / "later.ipynb",
        "%%distributed -n 2 --no-tracking --background --display text\n"
        "import os, time\ntime.sleep(1)\nprint('finished on rank', os.environ['RANK'])",
        "print('the last cell')",
    )
    done = invoke("run", "later.ipynb", cwd=project)
    assert done.returncode == 0, done.stderr
    assert done.stdout.index("the last cell") < done.stdout.index("[rank 1] finished on rank 1")
    assert "waiting for background run" in done.stderr
    _notebook(
        project / "later-broken.ipynb",
        "%%distributed -n 2 --no-tracking --background --display text\nimport time\ntime.sleep(1)\n"
        "raise KeyError('late')",
    )
    broken = invoke("run", "later-broken.ipynb", cwd=project)
    assert broken.returncode == 1 and "KeyError: 'late'" in broken.stderr, broken.stderr


CHECKPOINTS_ON_SIGTERM = """
import os, signal, sys, time
rank = os.environ["RANK"]

def checkpoint(signum, frame):
    time.sleep(3)  # torchrun's grace is 30 s: a checkpoint on preemption takes seconds
    open(f"checkpoint-{rank}", "w").close()
    sys.exit(0)

signal.signal(signal.SIGTERM, checkpoint)
print("sleeping", flush=True)
time.sleep(600)
"""


@pytest.mark.serial  # a 1 s grace against a 3 s checkpoint: a loaded machine moves both
@pytest.mark.fault(
    "SIGTERM to `air-magic run` (preemption) while ranks have a checkpoint-on-SIGTERM handler",
    "the ranks get SIGTERM and finish their checkpoint within the grace (30 s default, "
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT or --stop-grace), then exit 143",
)
@pytest.mark.parametrize("grace", ["default", "torchrun-variable-1s"])
def test_sigterm_is_forwarded_and_the_ranks_get_their_grace(project, grace):
    (project / "preempted.py").write_text(CHECKPOINTS_ON_SIGTERM)
    env = environment()
    if grace != "default":
        env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = "1"
    proc = subprocess.Popen(
        [*command(), "run", "--no-tracking", "--json", "preempted.py"],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pids = _started_ranks(proc, 2)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143
    saved = sorted(p.name for p in project.glob("checkpoint-*"))
    assert saved == (["checkpoint-0", "checkpoint-1"] if grace == "default" else []), saved
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids)


def test_os_exit_zero_ends_a_scripts_rank_as_a_success_and_its_peers_run_on(project):
    (project / "exits_early.py").write_text(
        "import os, time\n"
        "if os.environ['RANK'] == '0':\n"
        "    print('rank 0 done', flush=True)\n"
        "    os._exit(0)\n"
        "time.sleep(2)\n"
        "print('rank 1 finished its work', flush=True)\n"
    )
    done = air_magic(project, "exits_early.py")
    assert done.returncode == 0, done.stderr  # under torchrun too
    assert "[rank 1] rank 1 finished its work" in done.stdout
    module = air_magic(project, "-m", "exits_early")
    assert module.returncode == 0 and "[rank 1] rank 1 finished its work" in module.stdout, module.stderr


def test_json_lines_parse_strictly_with_non_finite_values(project):
    (project / "losses.py").write_text(
        "import math\n\ndef losses():\n    return {'loss': math.nan, 'best': [math.inf, -math.inf, 1.5]}\n"
    )
    done = air_magic(project, "--json", "-n", "1", "losses:losses")
    assert done.returncode == 0, done.stderr

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    lines = [json.loads(line, parse_constant=refuse) for line in done.stdout.splitlines()]
    assert lines[-1]["values"] == [{"loss": "NaN", "best": ["Infinity", "-Infinity", 1.5]}]


def test_a_runs_experiment_is_named_after_its_script_module_or_notebook(project, store):
    pytest.importorskip("IPython")
    _notebook(project / "book.ipynb", "%%distributed -n 2 --display none\n1")
    for target in (["ddp.py", "x"], ["helpers:whoami"], ["book.ipynb"]):
        done = invoke("run", *target, cwd=project)
        assert done.returncode == 0, done.stderr
    for name in ("ddp", "helpers", "book"):
        experiment = store.get_experiment_by_name(name)
        assert experiment is not None, [e.name for e in store.search_experiments()]
        assert len(store.search_runs([experiment.experiment_id])) == 1


def test_a_notebook_runs_in_its_own_folder_and_refuses_what_it_cannot_take(project):
    pytest.importorskip("IPython")
    sub = project / "analysis"
    sub.mkdir()
    (sub / "data.txt").write_text("from the notebook's folder")
    (sub / "neighbour.py").write_text("WORD = 'imported'\n")
    _notebook(
        sub / "book.ipynb",
        "import neighbour\nprint(open('data.txt').read(), neighbour.WORD)",
        "%%distributed -n 2 --no-tracking --display text\nprint(open('data.txt').read())",
        "1 / 0",
    )
    done = invoke("run", "analysis/book.ipynb", cwd=project)
    assert done.returncode == 1, done.stderr
    assert "from the notebook's folder imported" in done.stdout
    assert "[rank 1] from the notebook's folder" in done.stdout
    assert "ZeroDivisionError" in done.stdout + done.stderr
    assert "\x1b[" not in done.stdout + done.stderr  # a pipe gets no colour codes
    for extra, said in (
        (["analysis/book.ipynb", "--lr", "3"], "a notebook takes no arguments"),
        (["--json", "analysis/book.ipynb"], "--json is for a script"),
        (["--detach", "analysis/book.ipynb"], "--detach: a notebook's options go on its own %%distributed"),
    ):
        refused = invoke("run", *extra, cwd=project)
        assert refused.returncode == 2 and said in refused.stderr, (extra, refused.stderr)


def test_an_async_function_target_is_awaited(project):
    done = air_magic(project, "helpers:waits", "0.2")
    assert done.returncode == 0, done.stderr
    assert "rank 0: 0" in done.stdout and "rank 1: 1" in done.stdout
    assert "never awaited" not in done.stderr and "coroutine" not in done.stderr


def test_a_failure_shows_the_users_frames_once_and_sys_exit_no_traceback(project):
    (project / "raises.py").write_text("def main():\n    raise ValueError('bad batch')\n\nmain()\n")
    raised = air_magic(project, "-n", "1", "raises.py")
    assert raised.returncode == 1
    assert raised.stderr.count("ValueError: bad batch") == 2, raised.stderr  # live from the rank; the summary
    for ours in ("cli.py", "request.py", "targets.py", "runpy"):
        assert ours not in raised.stderr, raised.stderr
    exited = air_magic(project, "endings.py", "exit3")
    assert exited.returncode == 3
    assert "ScriptExit" not in exited.stderr and "Traceback" not in exited.stderr, exited.stderr
    assert exited.stderr.strip().splitlines()[-1] == "air-magic: exit status 3"


def test_runs_into_a_closed_pipe_and_in_time_order(project, tmp_path):
    logs = tmp_path / "logs"
    for _ in range(2):
        assert air_magic(project, "--log-dir", str(logs), "-n", "1", "endings.py", "none").returncode == 0
    listed = invoke("runs", "--log-dir", str(logs)).stdout.splitlines()
    ids = [line.split()[0] for line in listed]
    assert len(ids) == 2 and ids == sorted(ids, reverse=True)  # newest first
    read, write = os.pipe()
    os.close(read)  # as `air-magic runs | head -0`: the reader is gone
    try:
        closed = subprocess.run(
            [*command(), "runs", "--log-dir", str(logs)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            env=environment(),
            timeout=60,
        )
    finally:
        os.close(write)
    assert "Traceback" not in closed.stderr and "BrokenPipeError" not in closed.stderr, closed.stderr


def test_cancel_of_a_lost_run_says_it_was_lost(project, tmp_path):
    script = tmp_path / "forever.py"
    script.write_text("import time\nwhile True:\n    time.sleep(0.1)\n")
    started = air_magic(project, "--detach", "-n", "2", str(script))
    run_id = started.stdout.split("detached run ")[1].split()[0]
    deadline = time.monotonic() + 60
    while "running" not in invoke("runs", cwd=project).stdout.split(run_id)[1].splitlines()[0]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    import air_magic as am

    (run,) = [r for r in am.runs() if r.id == run_id]
    os.kill(run.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while [r.status for r in am.runs() if r.id == run_id] != ["lost"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    cancelled = invoke("cancel", run_id, cwd=project)
    assert (
        cancelled.returncode == 0 and "was lost" in cancelled.stdout and "cancelled" not in cancelled.stdout
    )
    from helpers.procs import reap_zombies

    reap_zombies()  # the killed supervisor was re-parented to pytest (a subreaper)
    assert air_magic(project, "-n", "1", "endings.py", "none").returncode == 0  # sweeps its call folder


def test_refusals_speak_the_command_lines_words(project):
    for args in (["-n", "0", "ddp.py"], ["--timeout", "-3", "ddp.py"]):
        done = air_magic(project, *args, timeout=60)
        assert done.returncode == 2 and "None" not in done.stderr, done.stderr


@pytest.mark.parametrize("option", [["--max-restarts", "1"], ["--local-ranks-filter", "0"]])
def test_detach_refuses_restarts_and_a_ranks_filter_in_one_clear_line(project, option):
    """Issue 48 #15: the refusal names the option it refuses, and what to do, in one line."""
    done = air_magic(project, "--detach", *option, "ddp.py", timeout=60)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"air-magic run: --detach cannot be combined with {option[0]}:"), line
    assert "run without --detach" in line


def test_runs_over_an_unreadable_runs_folder_is_one_line(project, tmp_path, monkeypatch, capsys):
    """Issue 48 #11: a log folder that is a file, or one that cannot be read (PermissionError,
    injected: tests run as root), is one line and status 2, not a traceback."""
    not_a_folder = tmp_path / "logs-file"
    not_a_folder.write_text("")
    done = invoke("runs", "--log-dir", str(not_a_folder))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("air-magic runs: cannot read the runs' folder") and str(not_a_folder) in line

    from air_magic import cli
    from air_magic.calls import detached

    logs = tmp_path / "logs"
    logs.mkdir()
    real_scandir = os.scandir

    def refused(path="."):
        if os.fspath(path) in (str(logs), detached.root()):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", refused)
    for argv in (["runs", "--log-dir", str(logs)], ["runs"]):  # the log root, then the detached runs'
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        (line,) = err.strip().splitlines()
        assert line.startswith("air-magic runs: cannot read the") and "Permission denied" in line, err


def _detached_run(project, script: str) -> tuple[str, object]:
    """Start ``script`` with ``run --detach -n 2``: its id and its runs() entry."""
    import air_magic as am

    started = air_magic(project, "--detach", "-n", "2", script)
    assert started.returncode == 0, started.stderr
    run_id = started.stdout.split("detached run ")[1].split()[0]
    (run,) = [r for r in am.runs() if r.id == run_id]
    return run_id, run


def _status_of(run_id: str) -> list[str]:
    import air_magic as am

    return [r.status for r in am.runs() if r.id == run_id]


def test_a_torn_state_json_still_lists_and_attaches_its_run(project, tmp_path):
    """Issue 48 #11: a truncated state.json hid a running detached run from runs() and attach."""
    script, gate = _gated_script(tmp_path, "gated.py")
    run_id, run = _detached_run(project, str(script))
    deadline = time.monotonic() + 120
    while not all("before" in invoke("logs", run_id, str(rank), cwd=project).stdout for rank in (0, 1)):
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.2)
    state = os.path.join(run.folder, "state.json")
    with open(state, "w") as f:
        f.write('{"id": "' + run_id + '", "name": "gat')  # torn mid-write
    assert _status_of(run_id) == ["running"]
    follower = subprocess.Popen(
        [*command(), "attach", run_id],
        cwd=project,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.0)
    gate.touch()
    out, err = follower.communicate(timeout=120)
    assert follower.returncode == 0, err
    assert "[rank 1] rank 1 after" in out
    assert _status_of(run_id) == ["succeeded"]  # the supervisor's rewrite keeps the run listed


def test_a_run_lost_after_its_last_event_is_shown_lost_in_one_line(project, tmp_path, capsys):
    """Issue 48 #11: state.json says running, the supervisor is gone, no result: attach said
    "succeeded in 41.4 s" and then "ended without a result". Now one line, and the run is lost."""
    from helpers.procs import reap_zombies

    import air_magic as am

    script = tmp_path / "quick.py"
    script.write_text("print('done')\n")
    run_id, _ = _detached_run(project, str(script))
    deadline = time.monotonic() + 120
    while True:
        (run,) = [r for r in am.runs() if r.id == run_id]
        if run.status == "succeeded" and run.pid is not None and not psutil.pid_exists(run.pid):
            break
        assert time.monotonic() < deadline, "the supervisor did not end"
        reap_zombies()  # the supervisor was re-parented to pytest (a subreaper)
        time.sleep(0.1)
    state = os.path.join(run.folder, "state.json")
    with open(state) as f:
        fields = json.load(f)
    with open(state, "w") as f:
        json.dump({**fields, "status": "running"}, f)  # as if it died before its last rewrite
    os.unlink(os.path.join(run.folder, "result.pkl"))
    assert _status_of(run_id) == ["lost"]
    row = invoke("runs", cwd=project).stdout.split(run_id)[1].splitlines()[0]
    assert " lost " in row, row
    attached = invoke("attach", run_id, cwd=project)
    assert attached.returncode == 1
    assert "succeeded" not in attached.stdout + attached.stderr, attached
    assert "done" in attached.stdout, attached  # what it printed is replayed, then why it has no result
    (line,) = [x for x in attached.stderr.splitlines() if "was lost:" in x]
    assert f"detached run {run_id} was lost:" in line, line
    # The Python API follows what it can; its display does not say the lost run succeeded.
    handle = am.attach(run_id, display="text")
    assert handle.done()  # lost, known as it is attached (it was shown "running" for a moment)
    with pytest.raises(am.LaunchError, match="was lost"):
        handle.result(timeout=60)
    shown = capsys.readouterr()
    assert "succeeded in" not in shown.out + shown.err, shown
