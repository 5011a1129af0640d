"""Runs a helper program (the MLflow UI server) that dies with the process that started it.

    python -m air_magic.tracking.guard LIFELINE_FD -- PROGRAM [ARGS...]

The starter keeps the write end of a pipe open for its lifetime; this guard
starts PROGRAM in its own process group and, when the pipe reports EOF (the
starter ended, however it ended), stops that whole group: SIGTERM, a short
grace, SIGKILL. If PROGRAM exits first, the guard exits with its status.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from air_magic.protocol.wire import wait_for_eof


def main(argv: list[str]) -> int:
    fd = int(argv[0])
    command = argv[argv.index("--") + 1 :]
    child = subprocess.Popen(command, start_new_session=True)

    def watch() -> None:
        wait_for_eof(fd)
        _stop_group(child)

    threading.Thread(target=watch, daemon=True).start()
    return child.wait()


def _stop_group(child: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + 3
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
