"""Faults around the warm starter and a rank's last moments (issue "Faithful ranks", items 5, 8, 12).

Real ranks, a real starter, real signals. Each case is in the fault matrix
(docs/reliability.md).
"""

from __future__ import annotations

import os
import time

import pytest
from helpers.ranks import raise_everywhere_at_once, run_ranks

import air_magic
from air_magic import distributed, restart_warm_start
from air_magic.errors import ConfigurationError, DistributedTimeoutError, RankFailedError
from air_magic.node import warm

fault = pytest.mark.fault


def run(fn, *args, **settings):
    settings.setdefault("tracking", False)  # the starter's faults, not MLflow's, are tested here
    return run_ranks(fn, *args, **settings)


@pytest.fixture
def hanging_preload(tmp_path, monkeypatch):
    """A preload list whose import never ends: the starter is alive but never ready."""
    (tmp_path / "hangs_at_import.py").write_text("import time\ntime.sleep(3600)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("AIR_MAGIC_PRELOAD", "hangs_at_import")
    restart_warm_start()
    yield
    restart_warm_start()


@fault(
    "the warm starter never becomes ready, call with timeout=5",
    "a timeout error after about 5 s that names the starter; no rank is blamed, none ran",
)
def test_a_starter_that_never_gets_ready_is_bounded_by_the_timeout(hanging_preload):
    began = time.monotonic()
    with pytest.raises(DistributedTimeoutError) as info:
        run(lambda: 1, timeout=5, wait_for_starter=False)  # the starter never comes: that is the test
    took = time.monotonic() - began
    message = str(info.value)
    assert "before any rank started" in message and "warm starter" in message
    assert "hangs_at_import" in message and "was still running" not in message
    assert info.value.still_running == []
    assert took < 60  # not the old 120 s wait (a generous bound: this machine is shared)
    assert air_magic.last_run().rank_states == {}


@fault(
    "Backend.stop() while the call waits for a warm starter that never becomes ready",
    "the call ends 'interrupted' at once with a clear error; no rank ran, nothing is left",
)
def test_stop_while_waiting_for_the_starter_ends_the_call(hanging_preload):
    import inspect
    import threading

    from air_magic.backends.local.backend import LocalBackend
    from air_magic.calls.call import run_call
    from air_magic.errors import LaunchError
    from air_magic.launch.settings import make_settings

    backend = LocalBackend(warm_start=True)
    threading.Timer(1.0, backend.stop).start()
    began = time.monotonic()
    settings = make_settings(num_accelerators=2, display="none", tracking=False)
    result = run_call("f", os.getpid, inspect.signature(os.getpid).bind(), settings, backend=backend)
    assert time.monotonic() - began < 10  # not the starter's 60 s
    assert result.outcome == "interrupted"
    with pytest.raises(LaunchError, match="was stopped"):
        result.unwrap()
    assert air_magic.last_run().rank_states == {}


@fault(
    "the warm starter never becomes ready, no timeout",
    "after AIR_MAGIC_STARTER_WAIT it is dropped (said once) and the call runs fresh ranks; "
    "later calls do not wait",
)
def test_a_starter_that_never_gets_ready_is_dropped_and_calls_go_cold(hanging_preload, monkeypatch, capfd):
    monkeypatch.setenv("AIR_MAGIC_STARTER_WAIT", "3")
    assert run(os.getppid) == [os.getpid()] * 2  # fresh ranks: this process is their parent
    assert "did not become ready in 3 s" in capfd.readouterr().err
    assert warm.starter_pid() is None  # dropped, not left importing forever
    began = time.monotonic()
    assert run(os.getppid) == [os.getpid()] * 2
    assert time.monotonic() - began < 30  # no second wait for a starter
    assert "did not become ready" not in capfd.readouterr().err


def _kill_the_starter_after_returning():
    """Return at once; a thread kills the warm starter (rank 0) while the ranks are still exiting."""
    import os
    import signal
    import threading
    import time

    starter = os.getppid()

    def later():
        time.sleep(0.5)
        if os.environ["RANK"] == "0":
            os.kill(starter, signal.SIGKILL)
        time.sleep(1.0)

    threading.Thread(target=later).start()  # not a daemon: the rank exits after it
    return int(os.environ["RANK"]) * 10


@fault(
    "the warm starter is killed after the ranks returned, before they exit",
    "the results already written count: the call succeeds; the next call gets a new starter",
)
def test_results_written_before_the_starter_died_count(starter):
    assert run(_kill_the_starter_after_returning) == [0, 10]
    assert air_magic.last_run().rank_states == {0: "succeeded", 1: "succeeded"}
    assert starter.proc.poll() is not None
    # A new starter took over: the ranks are forks of one, neither the killed one nor the caller.
    # (Not compared with warm.starter_pid() afterwards: once, under CI's load, the current
    # starter was already another one by then; see issue 33's note of 2026-12-05.)
    parents = run(os.getppid)
    assert len(set(parents)) == 1 and parents[0] not in (starter.proc.pid, os.getpid()), parents


def _kill_the_starter_then_die():
    import os
    import signal
    import time

    if os.environ["RANK"] == "1":
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(0.3)
        os._exit(3)
    time.sleep(30)


@fault(
    "the warm starter is killed, then a rank dies without a result",
    "that rank is named with its status unknown (the starter died), not as an out-of-memory kill",
)
def test_a_rank_whose_status_was_lost_is_not_blamed_on_oom(starter):
    with pytest.raises(RankFailedError) as info:
        run(_kill_the_starter_then_die)
    message = str(info.value)
    assert info.value.rank == 1
    assert "exit status is unknown" in message and "warm starter" in message
    assert "out-of-memory" not in message


def _exit_three():
    import sys

    sys.exit(3)


@fault(
    "a rank calls sys.exit(3)",
    "a failure that says SystemExit(3) and to return instead; not 'could not be sent back'",
)
def test_sys_exit_in_a_rank_is_explained():
    with pytest.raises(RankFailedError) as info:
        run(_exit_three)
    message = str(info.value)
    assert "SystemExit(3)" in message and "Return instead" in message
    assert "could not be sent back" not in message


def _return_more_than_the_file_size_limit():
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    return b"x" * (4 << 20)


@fault(
    "a rank's result cannot be written (file size limit, as with a full disk)",
    "the OS error with a note that the rank returned but its result could not be written",
)
def test_a_result_that_cannot_be_written_is_named():
    with pytest.raises(OSError) as info:
        run(_return_more_than_the_file_size_limit, n=1)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "returned, but its result could not be written" in notes
    assert "sys.exit" not in str(info.value) + notes


@fault(
    "every rank raises at the same moment (warm: exit codes arrive late)",
    "every rank is shown failed, none as 'stopped by air_magic'",
)
def test_ranks_that_failed_by_themselves_are_not_shown_as_stopped(tmp_path):
    with pytest.raises(ValueError):
        run(raise_everywhere_at_once, str(tmp_path), n=3)
    assert set(air_magic.last_run().rank_states.values()) == {"failed"}


def _wait_for_the_payload_to_go(_argument):
    import os
    import time

    payload = os.path.join(os.environ["AIR_MAGIC_RUN_DIR"], "payload.pkl")
    deadline = time.monotonic() + 20
    while os.path.exists(payload) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not os.path.exists(payload)


def test_the_payload_is_deleted_once_every_rank_has_read_it():
    assert run(_wait_for_the_payload_to_go, "x" * 100) == [True, True]


@fault(
    "the log folder cannot be created (a file in the way)",
    "a ConfigurationError that names the folder and log_dir=; nothing launched",
)
def test_an_unusable_log_folder_gives_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    restart_warm_start()
    with pytest.raises(ConfigurationError, match="log_dir="):
        distributed(num_accelerators=2, display="none", tracking=False, log_dir=str(blocker / "logs"))(
            os.getpid
        ).distributed()


def test_the_starter_log_goes_to_log_dir(tmp_path):
    restart_warm_start()
    logs = tmp_path / "logs"
    distributed(num_accelerators=2, display="none", tracking=False, log_dir=str(logs))(
        os.getpid
    ).distributed()
    assert (logs / "starter.log").exists()
    restart_warm_start()
