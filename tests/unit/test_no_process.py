"""The unit tier refuses to start a process (tests/conftest.py): each way to start one raises."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest
from helpers.no_process import NO_PROCESS, ProcessStartRefused


@pytest.fixture
def tried(_unit_tests_start_no_process):
    """What the test tried to start; cleared at its end (they were refused on purpose)."""
    yield _unit_tests_start_no_process
    _unit_tests_start_no_process.clear()


@pytest.mark.parametrize(
    "start",
    [
        lambda: subprocess.run([sys.executable, "-c", "pass"], check=False),
        lambda: subprocess.check_output("true", shell=True),
        lambda: os.popen("true"),
        lambda: os.system("true"),
        lambda: os.fork(),
        lambda: os.posix_spawn(sys.executable, [sys.executable], {}),
        lambda: os.spawnv(os.P_WAIT, sys.executable, [sys.executable, "-c", "pass"]),
        lambda: os.execv(sys.executable, [sys.executable]),
        lambda: multiprocessing.Process(target=print).start(),
    ],
    ids=["run", "shell", "popen", "system", "fork", "posix_spawn", "spawnv", "execv", "multiprocessing"],
)
def test_every_way_to_start_a_process_is_refused(start, tried):
    with pytest.raises(ProcessStartRefused, match=NO_PROCESS):
        start()
    assert len(tried) == 1


def test_the_refusal_names_the_command(tried):
    with pytest.raises(ProcessStartRefused) as caught:
        subprocess.run(["git", "status"], check=False)
    assert "subprocess.Popen(['git', 'status'])" in str(caught.value)
