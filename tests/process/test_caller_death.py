"""The caller is interrupted or dies: every rank and its children go too (SPEC §6)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from helpers.paths import script
from helpers.procs import alive_after

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
