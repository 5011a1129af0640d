"""How the caller asks a rank for its Python stacks without py-spy: a signal and a file.

Each rank registers :mod:`faulthandler` on :data:`STACKS_SIGNAL` (a real-time
signal: Python code, torch and the usual launchers leave them alone), writing
every thread's stack to :func:`stacks_path` in the call's log folder. The file
is created only after the handler is in place, so the caller signals a rank
only once the file exists: the signal's default action (terminate) can never
reach a rank still starting. faulthandler writes from its C signal handler, so
a rank stuck in a collective, or holding the GIL in C code, still answers.
"""

from __future__ import annotations

import os
import signal

# SIGRTMIN+5: glibc keeps the first real-time signals for itself (Python's SIGRTMIN is past them).
STACKS_SIGNAL = signal.SIGRTMIN + 5


RANK_FILE_PREFIX = "stacks-rank-"


def stacks_path(log_dir: str, rank: int) -> str:
    """Where rank ``rank`` writes its stacks when signalled (appended, one dump after another)."""
    return os.path.join(log_dir, f"{RANK_FILE_PREFIX}{rank}.txt")
