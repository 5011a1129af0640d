"""``air_magic.runs()`` and ``air_magic.attach()``: detached runs here and on a Ray cluster.

A detached run is either a supervisor process on this machine (``calls/detached.py``)
or a Ray job on a cluster (``calls/ray_jobs.py``). The verbs that find one by its
id -- list, attach, cancel, logs -- look on this machine first, then, when a
cluster is named (``cluster="ray=ADDRESS"``, ``--cluster``) or ``$RAY_ADDRESS``
is set, on that cluster. The command line, the magics and the Python API all
come through here.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from air_magic.calls import detached, ray_jobs
from air_magic.calls.background import RunHandle
from air_magic.errors import ConfigurationError


def runs(cluster: str | None = None) -> list[detached.DetachedRun]:
    """Every detached run of this user on this machine and, with ``cluster`` ('ray=ADDRESS', default
    ``$RAY_ADDRESS``), every air_magic run on that Ray cluster; newest first."""
    found = detached.runs()
    address = ray_jobs.cluster_address(cluster)
    if address is not None:
        try:
            found += ray_jobs.runs(address)
        except Exception as exc:  # this machine's runs are still listed
            if cluster is not None:  # asked for by name: say it, as an error
                raise
            print(
                f"air_magic: the Ray cluster at {address} did not answer ({exc}); this machine's runs only",
                file=sys.stderr,
            )
    return sorted(found, key=lambda r: r.id, reverse=True)


def find(run: str | None, cluster: str | None = None) -> detached.DetachedRun | ray_jobs.JobRun:
    """The detached run ``run`` names (its id or the start of it; None: the newest running): one of
    this machine, else one on the cluster."""
    address = ray_jobs.cluster_address(cluster)
    try:
        return detached.find(run)
    except ConfigurationError as exc:
        if address is None or not str(exc).startswith("no "):  # "more than one" is the user's to settle
            raise
    return ray_jobs.find(run, address)


def attach(
    run: str | detached.DetachedRun | ray_jobs.JobRun | None = None,
    display: str = "auto",
    cluster: str | None = None,
    consumers: Sequence[Any] = (),
) -> RunHandle:
    """Re-open a detached run (default: the newest one still running), here or on the cluster: its
    output so far, then the stream; the handle's result() waits for the end, cancel() stops it."""
    found = run if isinstance(run, (detached.DetachedRun, ray_jobs.JobRun)) else find(run, cluster)
    if isinstance(found, detached.DetachedRun) and found.cluster is not None:  # as runs() listed it
        found = ray_jobs.find(found.id, found.cluster)
    if isinstance(found, ray_jobs.JobRun):
        return ray_jobs.attach(found, None, display, consumers)
    return detached.attach(found, display, consumers)
