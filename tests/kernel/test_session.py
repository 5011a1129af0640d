"""A persistent session (SPEC §15) in a real IPython shell, with real ranks and a real MLflow store.

State kept across cells, pull-back, a failing cell, a crashed rank, a hanging cell at its
timeout (one that recovers and one stuck in a collective), the options a cell may set,
status/restart/stop, MLflow (one run per session, a step per cell). Warm ranks for every probe;
fresh ones too where how a rank started decides the outcome (whose child it is: a crash, a kill
between cells, restart and stop; a fresh interpreter's torch and process group). What the other
probes check is the session's, the same for both (tests/process/test_warm_equals_fresh.py proves
the ranks alike), and the suite's 15 minutes are the budget. The kernel-only cases (interrupt,
kernel restart) are in test_session_kernel.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest
from helpers.procs import gone_within

pytest.importorskip("IPython")
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from air_magic.calls import cell_loop, persistent

fault = pytest.mark.fault
warm_only = pytest.mark.parametrize("session", ["warm"], indirect=True)


def cell(ip, body, line=""):
    with capture_output() as captured:
        result = ip.run_cell_magic("distributed", line, body)
    return result, captured


def line(ip, text):
    with capture_output() as captured:
        result = ip.run_line_magic("distributed", text)
    return result, captured


@pytest.fixture(params=["warm", "fresh"])
def session(ip, request):
    """A 2-rank session started with the magic (warm ranks, or fresh ones), stopped afterwards."""
    options = "--display text --no-tracking --timeout 60"
    if request.param == "fresh":
        options += " --no-warm-start"
    started, _ = line(ip, f"session start -n 2 {options}")
    yield started
    started.stop(quiet=True)
    assert persistent.active() is None


def _gone(pids, wait_s=10.0):
    return gone_within(pids, wait_s)


def test_ranks_keep_their_globals_and_process_group_across_cells(ip, session):
    pids = [session.call.pids[r] for r in range(2)]
    _, out = cell(
        ip, "import os, torch, torch.distributed as dist\nrank = int(os.environ['RANK'])\nprint('hi', rank)"
    )
    assert "[rank 1] hi 1" in out.stdout
    # rank 1's own `rank` (1) is kept: the notebook's copy (rank 0's) is not sent back
    values, _ = cell(ip, "t = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\n(rank, t.item())")
    assert values == [(0, 3.0), (1, 3.0)]
    assert ip.user_ns["rank"] == 0  # pulled back from rank 0
    # init_process_group in a cell is harmless in a session: the session's group is kept
    values, _ = cell(
        ip,
        "dist.init_process_group('gloo')\nout = dist.get_world_size()\ndist.destroy_process_group()\n"
        "dist.is_initialized()",
    )
    assert values == [True, True]
    # ... and one unlike the session's is kept too, with a warning that says so
    values, out = cell(
        ip,
        "dist.init_process_group('nccl', timeout=None)\nimport air_magic\n"
        "air_magic.init_process_group(timeout=30)\ndist.init_process_group('cpu:gloo')\ndist.get_backend()",
    )
    assert values == ["gloo", "gloo"]
    assert ":1: RuntimeWarning: init_process_group(backend='nccl') kept the session's" in out.stderr
    assert ":3: RuntimeWarning: init_process_group(timeout) kept the session's" in out.stderr
    assert out.stderr.count("kept the session's process group") == 4  # 2 ranks; 'cpu:gloo' is gloo
    values, _ = cell(ip, "rank")
    assert values == [0, 1]
    assert [session.call.pids[r] for r in range(2)] == pids  # the same processes throughout
    _, out = line(ip, "session status")
    assert f"session {session.id}: ready, 2 rank(s), 5 cell(s) run" in out.stdout
    assert "resident" in out.stdout


@warm_only
def test_a_name_the_notebook_rebinds_is_sent_again(ip, session):
    cell(ip, "lr = 0.1\nsteps = [1]")
    ip.run_cell("lr = 0.5")  # rebound here: the ranks get the notebook's value
    values, _ = cell(ip, "steps.append(2)\n(lr, len(steps))")
    assert values == [(0.5, 2), (0.5, 2)]
    # The ranks' own `steps` was not sent, so it is not watched (a model would be pickled at every
    # cell): the notebook's copy stays as it came back, until --pull asks for it.
    assert ip.user_ns["steps"] == [1]
    cell(ip, "len(steps)", "--pull steps")
    assert ip.user_ns["steps"] == [1, 2]
    ip.run_cell("steps = [9]")
    values, _ = cell(ip, "steps.append(3)\nsteps")  # rebound here: sent, and watched
    assert values == [[9, 3], [9, 3]] and ip.user_ns["steps"] == [9, 3]


@warm_only
@fault("a cell raises in a session", "the original exception and traceback; the session goes on")
def test_a_failing_cell_keeps_the_session(ip, session):
    cell(ip, "kept = 7")
    with pytest.raises(ZeroDivisionError):
        cell(ip, "import os\nif os.environ['RANK'] == '1':\n    1 / 0\nkept")
    assert persistent.active() is session
    values, _ = cell(ip, "kept + 1")
    assert values == [8, 8]


@warm_only
@fault(
    "a rank raises while its peers wait in a collective (session)",
    "the peers are interrupted; the raising rank's exception; the session ends if they stay stuck",
)
def test_an_error_while_peers_wait_in_a_collective(ip, session, monkeypatch):
    monkeypatch.setattr(cell_loop, "RECOVER_S", 1.0)  # rank 0 cannot recover (in C): no need to wait 3 s
    with pytest.raises(ValueError, match="rank 1 gave up"):
        cell(
            ip,
            "import os, time, torch, torch.distributed as dist\n"
            "if os.environ['RANK'] == '1':\n    raise ValueError('rank 1 gave up')\n"
            "dist.barrier()\n",
        )
    # rank 0 was blocked in gloo's barrier (C code): it could not be interrupted, so the session ended
    assert persistent.active() is None
    assert session.state == "ended"
    assert _gone(list(session.call.pids.values()))
    # Its record says why: the cell's root cause, not the stop that followed it.
    import json
    from pathlib import Path

    summary = json.loads(Path(session.log_dir, "run.json").read_text())
    assert summary["outcome"] == "failed" and "ValueError: rank 1 gave up" in summary["error"], summary
    # The cell's states: rank 1 failed (the session's stop that followed does not make it "killed").
    from air_magic.calls.history import last_run

    assert last_run().rank_states[1] == "failed", last_run().rank_states
    assert last_run().failed_rank == 1
    with pytest.raises(persistent.SessionEndedError, match="ended"):
        session.run_cell("1")


@fault("a session rank dies mid-cell (SIGKILL)", "the session ends, says which rank and how; no rank left")
def test_a_crashed_rank_ends_the_session_with_a_clear_message(ip, session):
    pids = list(session.call.pids.values())
    with pytest.raises(persistent.SessionEndedError) as info:
        cell(
            ip,
            "import os, signal, time\nif os.environ['RANK'] == '1':\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(30)",
        )
    message = str(info.value)
    assert "rank 1" in message and "SIGKILL" in message, message
    assert "session start" in message
    assert persistent.active() is None
    assert _gone(pids)
    _, out = line(ip, "session status")  # the last session, and how it ended
    assert f"session {session.id}: ended" in out.stdout and "SIGKILL" in out.stdout, out.stdout
    assert "resident" not in out.stdout and "rank 1: pid" in out.stdout, out.stdout  # no memory of the dead


@warm_only
@pytest.mark.serial  # a 2 s timeout that must find the rank mid-print
@fault("a session cell runs past its timeout", "stacks and last lines; interrupted; the session goes on")
def test_a_hanging_cell_hits_its_timeout_and_the_session_recovers(ip, session):
    with pytest.raises(TimeoutError) as info:
        cell(ip, "import time\nprint('waiting', flush=True)\ntime.sleep(60)", "--timeout 2")
    message = str(info.value)
    assert "timed out after 2 s" in message and "goes on" in message, message
    assert "waiting" in message and "stacks.txt" in message  # last lines, and where it was
    assert persistent.active() is session
    values, _ = cell(ip, "'alive'")
    assert values == ["alive", "alive"]
    with pytest.raises(TimeoutError) as quiet:  # prints nothing: nothing of the earlier cells is quoted
        cell(ip, "import time\ntime.sleep(60)", "--timeout 2")
    assert "waiting" not in str(quiet.value) and "(nothing printed)" in str(quiet.value), str(quiet.value)


@warm_only
@pytest.mark.serial  # a 2 s timeout
@fault(
    "a session cell hangs in a collective past its timeout",
    "the session ends and says why; every rank gone",
)
def test_a_cell_stuck_in_a_collective_ends_the_session_at_its_timeout(ip, session, monkeypatch):
    monkeypatch.setattr(cell_loop, "RECOVER_S", 1.0)  # rank 0 cannot recover (in C): no need to wait 3 s
    pids = list(session.call.pids.values())
    with pytest.raises(TimeoutError) as info:
        cell(
            ip,
            "import os, time, torch.distributed as dist\n"
            "if os.environ['RANK'] == '0':\n    dist.barrier()\nelse:\n    time.sleep(60)\n",
            "--timeout 2",
        )
    assert "did not stop" in str(info.value), str(info.value)
    assert persistent.active() is None and _gone(pids)


@warm_only
def test_a_cell_may_set_its_timeout_and_display_only(ip, session):
    with pytest.raises(UsageError, match="asks for 3 rank"):
        cell(ip, "1", "-n 3")
    with pytest.raises(UsageError, match="--env: set for the whole session"):
        cell(ip, "1", "--env A=1")
    with pytest.raises(UsageError, match="background"):
        cell(ip, "1", "--background")
    with pytest.raises(UsageError, match="stop it first"):
        line(ip, "session start -n 2")
    values, _ = cell(ip, "1", "-n 2 --display none --timeout 30")
    assert values == [1, 1]


def test_restart_gives_new_ranks_and_stop_leaves_none(ip, session):
    cell(ip, "kept = 1")
    old = list(session.call.pids.values())
    new, _ = line(ip, "session restart")
    try:
        assert persistent.active() is new and new is session  # in place: the name held goes on
        assert _gone(old)
        with pytest.raises(NameError):
            new.run_cell("kept")
        pids = list(new.call.pids.values())
        _, out = line(ip, "session stop")
        assert "stopped; every rank is gone" in out.stdout
        assert _gone(pids, wait_s=1.0)
    finally:
        new.stop(quiet=True)


def test_the_context_manager_runs_functions_and_cells():
    import air_magic

    def where(offset):
        import os

        return int(os.environ["RANK"]) + offset

    with air_magic.session(num_accelerators=2, display="none", tracking=False) as s:
        assert persistent.active() is s
        assert s.run(where, 10) == [10, 11]
        s.run_cell("import os\ncount = int(os.environ['RANK'])")
        assert s.run_cell("count += 5\ncount") == [5, 6]
        pids = list(s.call.pids.values())
    assert persistent.active() is None and _gone(pids, wait_s=1.0)


def test_one_mlflow_run_per_session_with_a_step_per_cell(ip, tmp_path):
    from mlflow.tracking import MlflowClient

    from air_magic.paths import embedded_mlflow_uri

    started, _ = line(ip, "session start -n 2 --display none")
    try:
        cell(ip, "import mlflow\nmlflow.log_metric('loss', 1.5)\nx = 1")
        with pytest.raises(NameError):
            cell(ip, "undefined_name")
        run_id = started.record.run_id
        # A rank dies mid-cell: the session ends, and that cell's step is in the run all the same.
        with pytest.raises(persistent.SessionEndedError):
            cell(ip, "import os, signal\nif os.environ['RANK'] == '1': os.kill(os.getpid(), signal.SIGKILL)")
    finally:
        started.stop(quiet=True)
    client = MlflowClient(embedded_mlflow_uri())
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"  # a rank of the session died
    assert run.data.tags["air_magic.kind"] == "session"
    assert run.data.tags["air_magic.cells"] == "3"
    assert run.data.metrics["loss"] == 1.5  # what the ranks log goes into the session's run
    steps = [(m.step, m.value) for m in client.get_metric_history(run_id, "air_magic.cell_succeeded")]
    assert sorted(steps) == [(1, 1.0), (2, 0.0), (3, 0.0)]
    artifacts = [a.path for a in client.list_artifacts(run_id, "cells")]
    assert artifacts == ["cells/cell-0001.py", "cells/cell-0002.py", "cells/cell-0003.py"]


def test_a_rank_killed_between_cells_is_reported_at_the_next_cell(ip, session):
    os.kill(session.call.pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while session.call.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(persistent.SessionEndedError, match="between cells") as info:
        cell(ip, "1")  # not fresh ranks with the notebook's copies: the session's end, said once
    assert "SIGKILL" in str(info.value), str(info.value)
    assert persistent.active() is None
    assert cell(ip, "1", "-n 2 --display none --no-tracking")[0] == [1, 1]  # then cells run fresh


@warm_only
def test_a_name_the_ranks_hold_but_could_not_send_back_is_not_overwritten(ip, session):
    ip.run_cell("lock = 5")
    _, out = cell(ip, "import threading\nlock = threading.Lock()")
    assert "not brought back: lock" in out.stdout and ip.user_ns["lock"] == 5
    values, _ = cell(ip, "type(lock).__name__")  # the notebook's stale 5 is not sent over the ranks' lock
    assert values == ["lock", "lock"]
    ip.run_cell("lock = 6")  # rebound here: sent
    values, _ = cell(ip, "lock")
    assert values == [6, 6]


@warm_only
def test_each_cell_follows_the_notebooks_folder_environment_and_sys_path(ip, session, tmp_path, monkeypatch):
    (tmp_path / "late_module.py").write_text("WHERE = 'imported from the new sys.path'\n")
    monkeypatch.chdir(tmp_path)  # %cd after the session started
    monkeypatch.setenv("AFTER_START", "set later")
    monkeypatch.setenv("MASTER_PORT", "1")  # the launcher's: the ranks keep theirs, and it is said
    monkeypatch.syspath_prepend(str(tmp_path))
    result, out = cell(
        ip,
        "import os, late_module\n(os.getcwd(), os.environ.get('AFTER_START'), late_module.WHERE, "
        "os.environ['MASTER_PORT'] != '1')",
        "--display none",
    )
    assert result == [(str(tmp_path), "set later", "imported from the new sys.path", True)] * 2
    assert out.stderr.count("keep their own MASTER_PORT") == 1, out.stderr
    monkeypatch.delenv("AFTER_START")
    result, out = cell(ip, "import os\nos.environ.get('AFTER_START', 'gone')", "--display none")
    assert result == ["gone", "gone"] and "MASTER_PORT" not in out.stderr  # said once
    home = os.environ["HOME"]
    monkeypatch.setenv("HOME", "/elsewhere")
    assert cell(ip, "import os\nos.environ['HOME']", "--display none")[0] == ["/elsewhere"] * 2
    monkeypatch.setenv("HOME", home)  # back to the value the session started with: followed too
    assert cell(ip, "import os\nos.environ['HOME']", "--display none")[0] == [home] * 2


class Box:
    def __init__(self, v):
        self.v = v


@warm_only
def test_an_object_changed_in_place_in_the_notebook_is_sent_again(ip, session):
    ip.user_ns["Box"] = Box
    cell(ip, "b = Box(1)", "--display none")  # made in the ranks, brought back
    assert ip.user_ns["b"].v == 1
    ip.run_cell("b.v = 100")  # changed here, in place: the same object
    values, _ = cell(ip, "b.v", "--display none")
    assert values == [100, 100]
    cell(ip, "b.v += 1", "--display none")  # changed in the ranks: theirs wins, and comes back
    assert ip.user_ns["b"].v == 101
    values, _ = cell(ip, "b.v", "--display none")  # unchanged here since: the ranks' own is used
    assert values == [101, 101]


@warm_only
def test_a_session_with_a_failed_cell_is_not_listed_as_succeeded(ip, session):
    import json
    from pathlib import Path

    cell(ip, "1")
    with pytest.raises(ZeroDivisionError):
        cell(ip, "1 / 0")
    cell(ip, "2")
    session.stop(quiet=True)
    summary = json.loads(Path(session.log_dir, "run.json").read_text())
    assert summary["outcome"] == "failed", summary
    assert "1 of 3 cell(s) failed; the first, cell 2: ZeroDivisionError" in summary["error"]


@warm_only
def test_leaving_a_session_held_by_a_non_daemon_thread_says_why(ip, session, capsys):
    pids = list(session.call.pids.values())
    cell(ip, "import threading, time\nthreading.Thread(target=time.sleep, args=(600,)).start()")
    capsys.readouterr()
    session.stop(wait_s=4)
    err = capsys.readouterr().err
    assert "still ending 2 s after the stop (a thread that is not a daemon" in err, err
    assert "stacks.txt" in err and "they are stopped at 4 s" in err
    assert _gone(pids)


@warm_only
def test_the_end_a_cell_said_is_not_said_again_by_the_next_cell(ip, session):
    with pytest.raises(persistent.SessionEndedError, match="ended during") as info:
        cell(ip, "import os, signal\nif os.environ['RANK'] == '1': os.kill(os.getpid(), signal.SIGKILL)")
    assert "SIGKILL" in str(info.value), str(info.value)
    # Said once, by the cell it ended under: the next cell is not told it ended "between cells".
    assert cell(ip, "1", "-n 2 --display none --no-tracking")[0] == [1, 1]


@warm_only
def test_a_session_cells_failed_rank_is_its_exceptions_root_cause(ip, session, monkeypatch):
    from helpers.recording import Recorder

    from air_magic.protocol.events import RunFinished

    recorder = Recorder()
    made = cell_loop.make_consumers
    monkeypatch.setattr(cell_loop, "make_consumers", lambda *a: [*made(*a), recorder])
    with pytest.raises(ValueError, match="rank 1 first") as info:
        cell(  # rank 1 raises first; rank 0 raises on its own later: the root cause is rank 1, not 0
            ip,
            "import os, time\nif os.environ['RANK'] == '1':\n    raise ValueError('rank 1 first')\n"
            "time.sleep(0.5)\nraise ValueError('rank 0 later')",
        )
    assert info.value.air_magic_rank == 1
    (finished,) = recorder.of(RunFinished)
    assert finished.failed_rank == 1, finished  # its tab, its history line, its MLflow tag


def test_a_restarted_sessions_history_and_mlflow_run_say_the_same(ip):
    import json
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    from air_magic.paths import embedded_mlflow_uri

    started, _ = line(ip, "session start -n 2 --display none --timeout 60")
    try:
        with pytest.raises(ZeroDivisionError):
            cell(ip, "1 / 0")
        with pytest.raises(TimeoutError):
            cell(ip, "import time\ntime.sleep(60)", "--timeout 1")
        log_dir, record = started.log_dir, started.record  # the first session's (restart is in place)
        new, _ = line(ip, "session restart")
        new.stop(quiet=True)
    finally:
        started.stop(quiet=True)
    summary = json.loads(Path(log_dir, "run.json").read_text())
    run = MlflowClient(embedded_mlflow_uri()).get_run(record.run_id)
    assert summary["outcome"] == run.data.tags["air_magic.outcome"] == "failed", (summary, run.data.tags)
    assert run.info.status == "FAILED"
    assert summary["error"].startswith("2 of 2 cell(s) failed; the first, cell 1: ZeroDivisionError")
    assert run.data.tags["air_magic.error"] == summary["error"][: len(run.data.tags["air_magic.error"])]


@warm_only
@fault(
    "a session rank is interrupted before it has started the cell (a loaded machine)",
    "the rank stops as it starts the cell; the session goes on",
)
def test_an_interrupt_that_comes_before_a_rank_starts_the_cell_is_not_lost(ip, session):
    """Between cells a rank ignores SIGINT (a late one must not end it), so a rank that a loaded
    machine held back until after the interrupt missed it, slept on and ended the session (issue 48,
    22). SIGSTOP holds rank 1 back until the caller has interrupted it after rank 0's error."""
    held = session.call.pids[1]
    os.kill(held, signal.SIGSTOP)

    def release_once_interrupted() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            current = session.loop.current
            if current is not None and current.interrupted:  # set once SIGINT was sent
                break
            time.sleep(0.01)
        os.kill(held, signal.SIGCONT)

    releaser = threading.Thread(target=release_once_interrupted, daemon=True)
    releaser.start()
    try:
        with pytest.raises(ValueError, match="rank 0 gave up"):
            cell(
                ip,
                "import os, time\nif os.environ['RANK'] == '0':\n    raise ValueError('rank 0 gave up')\n"
                "time.sleep(60)\n",
            )
    finally:
        releaser.join()
        with contextlib.suppress(ProcessLookupError):  # gone where the session ended
            os.kill(held, signal.SIGCONT)
    assert persistent.active() is session, session.ended_why
    values, _ = cell(ip, "'alive'")
    assert values == ["alive", "alive"]


def _cell_on_a_thread(session, source):
    """``session.run_cell(source)`` on a thread of its own; (the thread, what it raised)."""
    raised: list[BaseException] = []

    def run():
        try:
            session.run_cell(source)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 60
    while session.loop.current is None or not session.loop.current.number:
        assert time.monotonic() < deadline, "the cell did not start"
        time.sleep(0.01)
    return thread, raised


def _stopped_while_in(session, source, capsys):
    """``session.stop()`` while ``source`` runs on another thread: what it said on stderr and what
    the cell raised; the cell's thread ended, nothing blamed on a non-daemon thread, no rank left."""
    pids = list(session.call.pids.values())
    thread, raised = _cell_on_a_thread(session, source)
    time.sleep(0.5)  # the ranks are in the cell's time.sleep
    capsys.readouterr()
    session.stop()
    thread.join(30)
    err = capsys.readouterr().err
    assert not thread.is_alive() and "not a daemon" not in err, err
    assert _gone(pids)
    return err, raised


@warm_only
def test_a_stop_while_a_cell_runs_on_another_thread_interrupts_it_first(ip, session, capsys):
    """Issue 49 (second probe): the stop waited 10 s, then blamed a thread that is not a daemon."""
    err, raised = _stopped_while_in(session, "import time\ntime.sleep(600)", capsys)
    assert "cell 1 was running: its ranks get SIGINT" in err, err
    (error,) = raised
    assert isinstance(error, persistent.SessionEndedError) and "was stopped while cell ran" in str(error)


@warm_only
def test_a_stop_while_a_rank_cannot_be_interrupted_says_so_and_stops_it(ip, session, capsys, monkeypatch):
    monkeypatch.setattr(cell_loop, "RECOVER_S", 2.5)
    # Rank 0 does not hear SIGINT (as in C code that blocks it); rank 1 does, and leaves the cell.
    source = (
        "import os, signal, time\n"
        "if os.environ['RANK'] == '0':\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "time.sleep(600)"
    )
    err, raised = _stopped_while_in(session, source, capsys)
    assert "rank(s) 0 did not leave cell 1 within 2.5 s of SIGINT" in err, err
    assert raised and isinstance(raised[0], persistent.SessionEndedError)
