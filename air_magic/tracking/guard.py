"""Runs a helper program (the MLflow UI server) that dies with the process that started it.

    python -m air_magic.tracking.guard LIFELINE_FD -- PROGRAM [ARGS...]

The starter keeps the write end of a pipe open for its lifetime; this guard
starts PROGRAM in its own process group and, when the pipe reports EOF (the
starter ended, however it ended), stops that whole group: SIGTERM, a short
grace, SIGKILL. If PROGRAM exits first, the guard exits with its status.
"""

from __future__ import annotations

import subprocess
import sys
import threading

from air_magic.process_tree import stop_trees
from air_magic.protocol.wire import wait_for_eof

GRACE_S = 3.0  # mlflow server's workers get this long after SIGTERM to exit on their own


def main(argv: list[str]) -> int:
    fd = int(argv[0])
    command = argv[argv.index("--") + 1 :]
    child = subprocess.Popen(command, start_new_session=True)

    def watch() -> None:
        wait_for_eof(fd)
        stop_trees([child], GRACE_S)

    threading.Thread(target=watch, daemon=True).start()
    return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
