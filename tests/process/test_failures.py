"""The crash matrix (SPEC §6): real ranks that raise, exit, crash, get killed or hang.

Every test also passes the autouse ``no_leftovers`` fixture: no rank, and no
process a rank started, may be alive 5 s after the call returned.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from helpers.ranks import run_ranks as run

import air_magic
from air_magic import DistributedTimeoutError, RankFailedError, RemoteTraceback, distributed


def _raise_on(rank_to_fail):
    import os
    import time

    if int(os.environ["RANK"]) == rank_to_fail:
        raise ValueError(f"bad value on rank {rank_to_fail}")
    time.sleep(60)


@pytest.mark.fault(
    "a rank raises", "its own exception type, its traceback as __cause__, the rank named; the others stopped"
)
def test_rank_raises_original_type_with_remote_traceback():
    started = time.monotonic()
    with pytest.raises(ValueError, match="bad value on rank 1") as info:
        run(_raise_on, 1)
    assert time.monotonic() - started < 30  # the sleeping rank was stopped, not waited for
    exc = info.value
    assert exc.air_magic_rank == 1
    assert isinstance(exc.__cause__, RemoteTraceback)
    text = str(exc.__cause__)
    assert "rank 1 of 2" in text and "_raise_on" in text and 'raise ValueError(f"bad value' in text
    assert any("raised on rank 1 of 2" in note for note in exc.__notes__)
    info_run = air_magic.last_run()
    assert info_run.outcome == "failed"
    assert info_run.rank_states == {1: "failed", 0: "killed"}


class OddError(Exception):
    """An exception whose __init__ does not accept its own args: it cannot be unpickled."""

    def __init__(self, code, detail):
        super().__init__(f"odd {code}: {detail}")


def _raise_odd():
    raise OddError(7, "detail")


@pytest.mark.fault(
    "an exception with an unusual __init__ (cannot be unpickled)",
    "RankFailedError carrying the type, message and traceback",
)
def test_exception_that_cannot_be_rebuilt_becomes_rank_failed_error_with_the_text():
    with pytest.raises(RankFailedError) as info:
        run(_raise_odd)
    exc = info.value
    assert "OddError" in str(exc) and "odd 7: detail" in str(exc)
    assert "OddError: odd 7: detail" in exc.remote_traceback
    assert isinstance(exc.__cause__, RemoteTraceback)


def _exit_with(code):
    import os

    if os.environ["RANK"] == "1":
        print("about to exit")
        os._exit(code)
    import time

    time.sleep(60)


@pytest.mark.fault("os._exit(0) before returning", "RankFailedError: status 0 without a result; never a hang")
def test_exit_zero_without_a_result_is_a_failure_not_a_hang():
    with pytest.raises(RankFailedError, match="status 0 without returning a result") as info:
        run(_exit_with, 0)
    assert info.value.rank == 1 and info.value.exit_code == 0
    assert "about to exit" in str(info.value)


@pytest.mark.fault("os._exit(3)", "RankFailedError naming status 3")
def test_exit_with_status():
    with pytest.raises(RankFailedError, match="status 3") as info:
        run(_exit_with, 3)
    assert info.value.exit_code == 3


def _segfault():
    import ctypes
    import os

    if os.environ["RANK"] == "0":
        ctypes.string_at(0)  # read address 0: a real SIGSEGV in C
    import time

    time.sleep(60)


@pytest.mark.fault(
    "SIGSEGV in native code", "RankFailedError naming SIGSEGV; faulthandler's stack in the log"
)
def test_sigsegv_is_named_and_faulthandler_stack_is_logged():
    with pytest.raises(RankFailedError, match="SIGSEGV") as info:
        run(_segfault)
    assert info.value.rank == 0 and info.value.exit_code == -signal.SIGSEGV
    log = Path(air_magic.last_run().log_path(0)).read_text()
    assert "Fatal Python error: Segmentation fault" in log and "_segfault" in log


def _sigkill_self():
    import os
    import signal
    import time

    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


@pytest.mark.fault(
    "SIGKILL (what the out-of-memory killer sends)", "RankFailedError naming SIGKILL and the likely OOM cause"
)
def test_sigkill_names_the_likely_oom_killer():
    with pytest.raises(RankFailedError, match=r"SIGKILL.*out-of-memory") as info:
        run(_sigkill_self)
    assert info.value.rank == 1


def _oom_scores():
    import os

    def score(pid):
        with open(f"/proc/{pid}/oom_score_adj") as f:
            return int(f.read())

    return score(os.getpid()), score(int(os.environ["AIR_MAGIC_CALLER_PID"]))


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "fresh"])
def test_ranks_are_the_oom_killers_first_choice_not_the_caller(warm):
    """Out of memory, the kernel kills the highest score: a rank (its SIGKILL is then reported as
    the likely OOM cause, above), never the notebook's process first (seen: 200 fresh ranks on a
    23 GB machine, the caller was killed)."""
    if not os.path.exists("/proc/self/oom_score_adj"):
        pytest.skip("no /proc/self/oom_score_adj here")
    with open("/proc/self/oom_score_adj") as f:
        ours = int(f.read())
    scores = distributed(num_accelerators=2, display="none", tracking=False, warm_start=warm)(
        _oom_scores
    ).distributed()
    assert scores == [(max(ours, 500), ours)] * 2


def _hang():
    import os
    import time

    print(f"rank {os.environ['RANK']} is stuck", flush=True)
    time.sleep(600)


@pytest.mark.fault(
    "a hang, stopped by timeout",
    "DistributedTimeoutError listing the ranks still running and their last lines",
)
def test_timeout_stops_every_rank_and_lists_their_last_lines():
    started = time.monotonic()
    with pytest.raises(DistributedTimeoutError) as info:
        run(_hang, timeout=3)
    assert time.monotonic() - started < 15
    exc = info.value
    assert exc.still_running == [0, 1]
    assert "rank 0 is stuck" in str(exc) and "rank 1 is stuck" in str(exc)
    assert isinstance(exc, TimeoutError)
    assert air_magic.last_run().outcome == "timeout"


def _staggered_failures():
    import os
    import time

    rank = int(os.environ["RANK"])
    time.sleep(0.4 * (3 - rank))  # rank 2 fails first, then 1, then 0
    raise RuntimeError(f"rank {rank} failed")


@pytest.mark.fault("ranks fail one after another", "the earliest failure is raised")
def test_root_cause_is_the_earliest_failure():
    with pytest.raises(RuntimeError, match="rank 2 failed") as info:
        run(_staggered_failures, n=3)
    assert info.value.air_magic_rank == 2


def _fails_before_collective():
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if os.environ["RANK"] == "1":
        raise KeyError("rank 1 lost its key")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits here for a peer that is gone
    return t.item()


@pytest.mark.fault(
    "a rank raises while its peer waits in a gloo collective",
    "that rank's error, not the peer's connection error",
)
def test_collective_abort_in_the_others_is_not_the_root_cause():
    with pytest.raises(KeyError, match="rank 1 lost its key") as info:
        run(_fails_before_collective)
    assert info.value.air_magic_rank == 1


def _killed_during_collective():
    import os
    import signal

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if os.environ["RANK"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


@pytest.mark.fault(
    "a rank is SIGKILLed while its peer waits in a collective", "the killed rank is the root cause"
)
def test_a_killed_rank_is_the_root_cause_not_its_peers_connection_error():
    with pytest.raises(RankFailedError, match="SIGKILL") as info:
        run(_killed_during_collective)
    assert info.value.rank == 0


def _spawns_children_then_fails():
    import multiprocessing
    import os
    import subprocess
    import time

    subprocess.Popen(["sleep", "300"])  # same process group
    subprocess.Popen(["sleep", "301"], start_new_session=True)  # escaped the group
    ctx = multiprocessing.get_context("fork")
    ctx.Process(target=time.sleep, args=(302,)).start()  # like a DataLoader worker
    time.sleep(0.5)
    if os.environ["RANK"] == "1":
        raise RuntimeError("failing with children")
    time.sleep(60)


@pytest.mark.fault(
    "a failing rank's children (DataLoader-like, and one that left the group)", "all stopped with the rank"
)
def test_a_failing_ranks_children_are_stopped_too():
    # no_leftovers checks that every sleep above is gone.
    with pytest.raises(RuntimeError, match="failing with children"):
        run(_spawns_children_then_fails)


def _leaves_children_behind():
    import subprocess

    subprocess.Popen(["sleep", "303"])
    subprocess.Popen(["sleep", "304"], start_new_session=True)
    return "done"


@pytest.mark.fault("a successful rank leaves children running", "all stopped after the call")
def test_children_left_by_a_successful_rank_are_stopped():
    assert run(_leaves_children_behind) == ["done", "done"]


def _system_exit():
    import sys

    sys.exit(0)


@pytest.mark.fault("sys.exit() in a rank", "RankFailedError; the caller keeps running")
def test_sys_exit_in_a_rank_does_not_exit_the_caller():
    with pytest.raises(RankFailedError, match="SystemExit"):
        run(_system_exit)


class Halt(BaseException):  # like torch's CheckpointException: a BaseException that is not an exit
    pass


def _raises_a_base_exception():
    raise Halt("checkpoint failed on this rank")


@pytest.mark.fault(
    "a rank raises a BaseException that is not an exit (torch's CheckpointException)",
    "that exception's own type, with the rank's traceback; no word of sys.exit",
)
def test_a_base_exception_that_is_not_an_exit_comes_back_as_itself():
    from air_magic.errors import RemoteTraceback

    with pytest.raises(Halt, match="checkpoint failed on this rank") as raised:
        run(_raises_a_base_exception)
    assert isinstance(raised.value.__cause__, RemoteTraceback)
    assert "_raises_a_base_exception" in raised.value.__cause__.text
    assert "sys.exit" not in "".join(getattr(raised.value, "__notes__", []))


def _returns_lock():
    import threading

    return {"ok": 1, "lock": threading.Lock()}


@pytest.mark.fault("an unpicklable return value", "PayloadError naming the part that cannot be pickled")
def test_unpicklable_return_value_is_named():
    with pytest.raises(air_magic.PayloadError, match=r"return value\[.lock.\] cannot be sent back"):
        run(_returns_lock)


@pytest.mark.fault("an unpicklable argument", "PayloadError naming its path; nothing starts")
def test_unpicklable_argument_is_named_before_launch():
    import threading

    class Config:
        def __init__(self):
            self.lr = 0.1
            self.lock = threading.Lock()

    before = air_magic.last_run()
    with pytest.raises(
        air_magic.PayloadError, match=r"argument 'cfg'\.lock.*cannot be pickled|argument 'cfg'\.lock"
    ):
        distributed(display="none")(lambda cfg: cfg.lr).distributed(Config())
    assert air_magic.last_run() is before  # nothing was launched


_GLOBAL_LOCK = __import__("threading").Lock()


def _uses_global_lock():
    return _GLOBAL_LOCK.locked()


@pytest.mark.fault(
    "an unpicklable global of a notebook function", "PayloadError naming the global; nothing starts"
)
def test_unpicklable_global_of_a_notebook_style_function_is_named():
    # Re-home the function in __main__, as a notebook cell would define it: cloudpickle sends it by value.
    fn = type(_uses_global_lock)(
        _uses_global_lock.__code__, {"_GLOBAL_LOCK": _GLOBAL_LOCK, "__name__": "__main__"}
    )
    with pytest.raises(air_magic.PayloadError, match="global '_GLOBAL_LOCK'"):
        distributed(display="none")(fn).distributed()


@pytest.mark.fault("a payload over the size limit", "PayloadError listing the largest parts; nothing starts")
def test_payload_over_the_limit_lists_the_largest_parts():
    with pytest.raises(
        air_magic.PayloadError, match=r"over the limit.*argument 'data': 2\.0 MiB.*inside the function"
    ):
        distributed(display="none", max_payload_bytes=2**20)(lambda data, small: len(data)).distributed(
            b"x" * (2 * 2**20), small=1
        )


def _stuck_in_a_collective():
    import os
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if os.environ["RANK"] == "1":
        time.sleep(600)
    t = torch.ones(1)
    dist.all_reduce(t)


@pytest.mark.fault("a hang in a gloo collective", "stopped by the timeout")
def test_hang_in_a_gloo_collective_is_stopped_by_the_timeout():
    with pytest.raises(DistributedTimeoutError) as info:
        run(_stuck_in_a_collective, timeout=8)
    assert info.value.still_running == [0, 1]


def test_run_directory_is_removed_and_logs_kept_after_failure():
    with pytest.raises(ValueError):
        run(_raise_on, 0)
    info = air_magic.last_run()
    assert os.path.isfile(info.log_path(0))
    # no_leftovers asserts the run directory is gone


def _escaped_child_then_sigkill():
    import os
    import signal
    import subprocess
    import time

    subprocess.Popen(["sleep", "305"], start_new_session=True)
    time.sleep(2.5)  # long enough for the launcher to have seen the child
    if os.environ["RANK"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


@pytest.mark.fault(
    "a SIGKILLed rank's children that left its process group", "stopped too (seen while the run went)"
)
def test_escaped_children_of_a_sigkilled_rank_are_stopped():
    with pytest.raises(RankFailedError, match="SIGKILL"):
        run(_escaped_child_then_sigkill)


@pytest.mark.fault("an unwritable log directory", "ConfigurationError before anything starts")
def test_unwritable_log_dir_fails_before_launch(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    target = locked / "logs"
    if os.access(locked, os.W_OK):  # root ignores directory permissions: use a file as the parent
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        target = blocker / "logs"
    with pytest.raises(air_magic.ConfigurationError, match="cannot create the run's log folder"):
        run(_raise_on, 0, log_dir=str(target))


def test_payload_limit_lists_a_big_global_of_the_function():
    big = b"y" * (3 * 2**20)
    fn = type(_uses_global_lock)(
        (lambda: len(BIG)).__code__,  # noqa: F821
        {"BIG": big, "__name__": "__main__"},
    )
    with pytest.raises(air_magic.PayloadError, match=r"global 'BIG': 3\.0 MiB"):
        distributed(display="none", max_payload_bytes=2**20)(fn).distributed()
