"""``air-magic`` run from a test as a shell runs it: its own process, the session's temp folder."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile


def command() -> list[str]:
    """The installed ``air-magic`` script, or ``python -m air_magic`` where there is none."""
    script = os.path.join(os.path.dirname(sys.executable), "air-magic")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "air_magic"]


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["TMPDIR"] = tempfile.gettempdir()  # the session's folder: its leftovers are checked
    env.pop("AIR_MAGIC_RUN_ID", None)
    return env


def invoke(*args: str, cwd=None, timeout: float = 180, program: list[str] | None = None):
    """``air-magic ARGS`` as a shell runs it; its CompletedProcess."""
    return subprocess.run(
        [*(program or command()), *args],
        cwd=cwd,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
