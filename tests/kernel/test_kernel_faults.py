"""Fault matrix cases that need a real Jupyter kernel: the cell magic's failures, restarts, kills.

Each checks what the user sees (the reply's error and traceback), that every
rank is gone within 5 s, that the kernel (or its replacement) still works, and
the MLflow run's final status.
"""

from __future__ import annotations

import os
import signal

import pytest
from helpers.procs import gone_within
from helpers.ranks import mlflow_status

pytest.importorskip("ipykernel")
from helpers.kernel import Kernel

from air_magic.calls.history import RunInfo

fault = pytest.mark.fault

WAIT_FOR_RANKS = (
    "%%distributed -n 2 --display text\n"
    "import os, time\n"
    "print(f'pid={os.getpid()} run={os.environ[\"MLFLOW_RUN_ID\"]}', flush=True)\n"
    "time.sleep(300)\n"
)


def _run_id_status(run_id: str) -> str:
    return mlflow_status(RunInfo("", "", 0, "", mlflow_run_id=run_id))


def _start_and_wait(kernel: Kernel, then) -> tuple[list[int], str, str]:
    """Send WAIT_FOR_RANKS; once both ranks printed their pid, call ``then()`` and return.

    Returns the ranks' pids, the call's MLflow run id and the execute request's id.
    """
    msg_id = kernel.kc.execute(WAIT_FOR_RANKS)
    pids, lines = kernel.wait_for_pids(msg_id, 2)
    run_ids = {line.split(" run=")[1] for line in lines if "pid=" in line}
    then()
    assert len(run_ids) == 1
    return pids, run_ids.pop(), msg_id


@pytest.fixture
def kernel(tmp_path):
    with Kernel(cwd=tmp_path) as k:
        k.run("%load_ext air_magic\nimport air_magic")
        yield k


@fault(
    "the notebook's stop button (interrupt_kernel) mid-run",
    "KeyboardInterrupt; ranks gone; run KILLED; kernel usable",
)
def test_interrupt_mid_run(kernel):
    pids, run_id, msg_id = _start_and_wait(kernel, kernel.km.interrupt_kernel)
    reply = kernel.kc.get_shell_msg(timeout=60)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    assert gone_within(pids)
    assert _run_id_status(run_id) == "KILLED"
    reply, _ = kernel.run_after_interrupt("1 + 1")
    assert reply["status"] == "ok"


@fault("kernel restart mid-run", "every rank gone within 5 s; the run is marked KILLED by the next call")
def test_kernel_restart_mid_run(kernel):
    old_pid = kernel.pid
    # restart_kernel waits for the old kernel to go: it runs beside the test, which watches the ranks,
    # and nothing reads the kernel's state until the restart is over and the new kernel answers.
    pids, run_id, _ = _start_and_wait(kernel, kernel.restart_in_background)
    assert gone_within(pids)
    assert kernel.wait_restarted() != old_pid
    assert kernel.run("%load_ext air_magic")[0]["status"] == "ok"
    reply, _ = kernel.run("%%distributed -n 2 --display none\n1\n")
    assert reply["status"] == "ok"
    assert _run_id_status(run_id) == "KILLED"


@fault("kernel SIGKILL mid-run", "every rank gone within 5 s; the run is marked KILLED by the next call")
def test_kernel_sigkill_mid_run(kernel, tmp_path):
    pids, run_id, _ = _start_and_wait(kernel, lambda: os.kill(kernel.pid, signal.SIGKILL))
    assert gone_within(pids)
    with Kernel(cwd=tmp_path) as fresh:
        reply, _ = fresh.run("%load_ext air_magic")
        reply, _ = fresh.run("%%distributed -n 2 --display none\n1\n")
        assert reply["status"] == "ok"
    assert _run_id_status(run_id) == "KILLED"


@fault("two kernels launching at once", "both succeed, each on its own rendezvous port")
def test_two_kernels_at_once(kernel, tmp_path):
    with Kernel(cwd=tmp_path) as other:
        other.run("%load_ext air_magic")
        cell = (
            "%%distributed -n 2 --display none\n"
            "import os, torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "t = torch.ones(1)\n"
            "dist.all_reduce(t)\n"
            "dist.destroy_process_group()\n"
            "(t.item(), os.environ['MASTER_PORT'])\n"
        )
        first = kernel.kc.execute(cell)
        second = other.kc.execute(cell)
        replies = [kernel.kc.get_shell_msg(timeout=120), other.kc.get_shell_msg(timeout=120)]
        assert [r["parent_header"]["msg_id"] for r in replies] == [first, second]
        assert all(r["content"]["status"] == "ok" for r in replies), replies


CELL_FAULTS = {
    "raise": (
        "import os\nif os.environ['RANK'] == '1':\n    raise ValueError('cell failed')\n",
        "ValueError",
    ),
    "exit": (
        "import os\nif os.environ['RANK'] == '0':\n    os._exit(3)\nimport time\ntime.sleep(60)\n",
        "RankFailedError",
    ),
    "sigkill": (
        "import os, signal, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(60)\n",
        "RankFailedError",
    ),
    "timeout": ("import time\ntime.sleep(60)\n", "DistributedTimeoutError"),
    "unpicklable-name": ("print(guard)\n", "PayloadError"),
}


@fault(
    "the cell magic: a rank raises, exits, is SIGKILLed, times out; an unpicklable name",
    "the error names the rank and cause; kernel usable; run FAILED",
)
@pytest.mark.timeout(300)  # five calls (one waits out its 3 s timeout) and a kernel's first imports
def test_cell_magic_failures_in_a_kernel(kernel):
    """One kernel through every case in turn (a kernel, its starter and MLflow's import cost seconds
    each): after each failure the next cell works, and so does the next case."""
    kernel.run("import threading\nguard = threading.Lock()")
    runs: list[str] = []
    for case, (body, ename) in sorted(CELL_FAULTS.items()):
        reply, _ = kernel.run(f"%%distributed -n 2 --timeout 3 --display none\n{body}")
        assert reply["status"] == "error" and reply["ename"] == ename, (case, reply)
        shown = "\n".join(reply["traceback"])
        if case == "unpicklable-name":
            assert "notebook variable 'guard'" in shown, shown
        else:
            assert "rank" in shown, (case, shown)
            run_id = kernel.printed("print(air_magic.last_run().mlflow_run_id)").strip()
            assert run_id not in runs, (case, "no run of its own")  # not the case before's
            runs.append(run_id)
            assert _run_id_status(run_id) == "FAILED", case
        assert kernel.run("2 + 2")[0]["status"] == "ok", case
