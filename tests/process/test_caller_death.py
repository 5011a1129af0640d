"""The caller is interrupted or dies: every rank and its children go too (SPEC §6)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers.paths import script
from helpers.procs import alive_after, gone_within

CALLER = script("caller.py")


def _start_caller(tmp_path, mode):
    args = [sys.executable, CALLER, str(tmp_path)] + (["--warm"] if mode == "warm" else [])
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    pids: list[int] = []
    while time.monotonic() < deadline and len(pids) < 4:
        pids = []
        for rank in (0, 1):
            path = tmp_path / f"rank-{rank}.pid"
            if path.exists():
                pids += [int(p) for p in path.read_text().split()]
        if proc.poll() is not None:
            raise AssertionError(f"caller ended early: {proc.communicate()}")
        time.sleep(0.05)
    assert len(pids) == 4, "ranks did not start"
    return proc, pids


@pytest.mark.fault(
    "SIGINT (Ctrl-C) to a caller script", "KeyboardInterrupt within seconds; ranks and their children gone"
)
@pytest.mark.parametrize("mode", ["cold", "warm"])
def test_sigint_to_the_caller_stops_every_rank_and_raises_keyboard_interrupt(tmp_path, mode):
    proc, pids = _start_caller(tmp_path, mode)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - sent < 10
    assert proc.returncode == 130, err
    assert "caller: KeyboardInterrupt" in out
    assert alive_after(pids, 1) == []


@pytest.mark.fault("SIGKILL of a caller script", "ranks and their children gone within 5 s")
@pytest.mark.parametrize("mode", ["cold", "warm"])
def test_sigkill_of_the_caller_takes_every_rank_and_child_within_5_s(tmp_path, mode):
    proc, pids = _start_caller(tmp_path, mode)
    proc.kill()
    proc.wait()
    assert alive_after(pids, 5) == []


def _start_script(script: str, tmp_path, mode: str):
    """``python -c script LOGS FLAGS MODE`` with warm ranks or fresh ones; (process, logs, flags)."""
    logs, flags = tmp_path / "logs", tmp_path / "flags"
    flags.mkdir()
    env = {**os.environ, "AIR_MAGIC_WARM": "1" if mode == "warm" else "0"}
    proc = subprocess.Popen([sys.executable, "-c", script, str(logs), str(flags), mode], env=env)
    return proc, logs, flags


PRINT_UNTIL_KILLED = r"""
import sys
import air_magic

@air_magic.distributed(num_accelerators=2, display="none", tracking=False, log_dir=sys.argv[1])
def printer(flags):
    import os
    import time
    rank = os.environ["RANK"]
    with open(os.path.join(flags, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    printed = open(os.path.join(flags, f"printed-{rank}"), "a", buffering=1)
    for n in range(10_000_000):
        print(f"line {n} of rank {rank}", flush=True)
        printed.write(f"{n}\n")  # after the line reached the rank's pipe
        if n % 10 == 0:
            time.sleep(0.001)  # fast, but a read of the caller's never splits a line (a full pipe)

if sys.argv[3] == "warm":  # the ranks below are forked by the warm starter
    from air_magic.node import warm

    assert warm.get_starter(wait_s=120) is not None, "the warm starter did not come up"
printer.distributed(sys.argv[2])
"""


@pytest.mark.fault(
    "SIGKILL of a caller script while its ranks print",
    "every line a rank printed before it went is in its log (the rank stops, appends what its "
    "pipes held, then goes)",
)
@pytest.mark.parametrize("mode", ["cold", "warm"])
def test_a_killed_caller_loses_no_line_its_ranks_printed(tmp_path, mode):
    proc, logs, flags = _start_script(PRINT_UNTIL_KILLED, tmp_path, mode)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            counts = [len((flags / f"printed-{r}").read_text().split()) for r in (0, 1)
                      if (flags / f"printed-{r}").exists()]  # fmt: skip
            if len(counts) == 2 and min(counts) > 2000:
                break
            time.sleep(0.02)
    finally:
        proc.kill()  # mid-print: lines in the pipes, read or not
        proc.wait()
    pids = [int((flags / f"pid-{rank}").read_text()) for rank in (0, 1)]
    assert gone_within(pids, 10), "the ranks did not follow their lifeline"
    (run,) = list(logs.iterdir())
    for rank in (0, 1):
        printed = (flags / f"printed-{rank}").read_text().split()
        logged = {
            int(line.split()[1])
            for line in (run / f"rank-{rank}.log").read_text().splitlines()
            if line.startswith("line ") and line.endswith(f"of rank {rank}")
        }
        missing = [n for n in map(int, printed) if n not in logged]
        assert not missing, (rank, len(printed), missing[:10])
    from air_magic import verbs

    (line,) = verbs.runs(str(logs))  # its run.json says running: its process is gone, so it is lost
    assert f"{run.name}  lost " in line, line


FLOOD_UNTIL_KILLED = r"""
import sys
import air_magic

@air_magic.distributed(num_accelerators=2, display="none", tracking=False, log_dir=sys.argv[1])
def flood(flags):
    import os
    with open(os.path.join(flags, f"pid-{os.environ['RANK']}"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        print("x" * 200, flush=True)  # blocks once the pipe is full and nobody reads it

if sys.argv[3] == "warm":
    from air_magic.node import warm

    assert warm.get_starter(wait_s=120) is not None, "the warm starter did not come up"
flood.distributed(sys.argv[2])
"""


@pytest.mark.fault(
    "the caller is frozen (SIGSTOP) while its ranks flood their pipes, then SIGKILLed",
    "every rank goes within seconds, though its print is blocked on a full pipe",
)
@pytest.mark.parametrize("mode", ["cold", "warm"])
def test_a_rank_blocked_on_a_full_pipe_still_dies_with_its_caller(tmp_path, mode):
    proc, _, flags = _start_script(FLOOD_UNTIL_KILLED, tmp_path, mode)
    try:
        deadline = time.monotonic() + 120
        while len(list(flags.iterdir())) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert len(list(flags.iterdir())) == 2, "the ranks did not start"
        proc.send_signal(signal.SIGSTOP)  # nobody reads the pipes: they fill, and the prints block
        time.sleep(1.5)
    finally:
        proc.kill()
        proc.wait()
    pids = [int((flags / f"pid-{rank}").read_text()) for rank in (0, 1)]
    assert gone_within(pids, 10), "a rank blocked on its full pipe outlived its caller"
