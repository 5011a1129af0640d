"""The unit tier's rule, no process started: every way to start one, refused (tests/conftest.py)."""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

NO_PROCESS = "a unit test must not start a process: move it to tests/process"


class ProcessStartRefused(RuntimeError):
    """What a unit test gets where it would start a process."""


# subprocess (and os.popen, asyncio's and pty's through it), fork (multiprocessing, pty.fork through
# forkpty), spawn and exec.
PROCESS_STARTS = (
    (subprocess.Popen, "__init__", "subprocess.Popen"),
    (multiprocessing.process.BaseProcess, "start", "multiprocessing.Process.start"),
    *(
        (os, name, f"os.{name}")
        for name in (
            "fork",
            "forkpty",
            "posix_spawn",
            "posix_spawnp",
            "system",
            "spawnv",
            "spawnve",
            "spawnvp",
            "spawnvpe",
            "execv",
            "execve",
            "execvp",
            "execvpe",
        )
        if hasattr(os, name)
    ),
)


def refuse_process_starts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Until ``monkeypatch`` undoes it, each way to start a process raises :class:`ProcessStartRefused`;
    the list returned says what was tried (so that a test which swallowed the error still fails)."""
    tried: list[str] = []

    def refusing(what: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            shown = args[1] if what == "subprocess.Popen" and len(args) > 1 else args[:1]
            tried.append(f"{what}({shown!r})"[:200])
            raise ProcessStartRefused(f"{NO_PROCESS} (it called {tried[-1]})")

        return refuse

    for owner, name, what in PROCESS_STARTS:
        monkeypatch.setattr(owner, name, refusing(what))
    return tried
