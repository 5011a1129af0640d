"""The open-file limit a call's ranks need, raised before they start (the caller and each node).

Called by the call loop (``backends/call_loop.py``: each rank's log in the caller) and by each
node's rank group (``node/rank_group.py``: each rank's pipes and pidfd) before ranks start.
"""

from __future__ import annotations

import os
import resource
import sys

from air_magic.errors import ConfigurationError

# Descriptors this process holds per rank while a call runs: stdout and stderr pipes, a pidfd,
# the rank's log, its metric file, a session's two pipes; and a margin for everything else.
FDS_PER_RANK = 8
FDS_MARGIN = 64


_said_open_files = False


def refuse_beyond_the_hard_limit(ranks: int) -> None:
    """Before anything of the call exists (its MLflow run, its log folder): a number of ranks whose
    descriptors this process could never hold (its hard limit) is a clear error, not "Too many open
    files" from deep inside the ranks' start."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = _needed(ranks)
    if hard != resource.RLIM_INFINITY and needed is not None and needed > hard:
        raise ConfigurationError(
            f"{ranks} ranks need about {needed} open files in this process, above its hard limit of "
            f"{hard} (ulimit -Hn): ask for fewer ranks, or raise the limit"
        )


def ensure_open_files(ranks: int) -> None:
    """Room for ``ranks`` more ranks' descriptors: the soft open-file limit raised as far as needed (up
    to the hard limit), and said once when even that is not enough."""
    global _said_open_files
    needed = _needed(ranks)
    if needed is None:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or needed <= soft:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            target = soft
    if target < needed and not _said_open_files:
        _said_open_files = True
        print(
            f"air_magic: {ranks} rank(s) need about {needed} open files here and the limit is {target} "
            f"(hard limit {hard}); raise it (ulimit -n) if ranks fail to start",
            file=sys.stderr,
        )


def _needed(ranks: int) -> int | None:
    """The descriptors this process needs with ``ranks`` more ranks (None: it cannot count its own)."""
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        return None
    return in_use + FDS_PER_RANK * ranks + FDS_MARGIN
