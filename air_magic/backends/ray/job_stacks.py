"""A Ray job's rank stacks for a follower elsewhere: ``python3 -m air_magic.backends.ray.job_stacks RUN``.

A follower of a detached run on Ray (``calls/ray_jobs.JobRun.stacks``) reaches
the cluster only through its Jobs API, and a running job has no channel in but
``stop``. So to see the stacks of the run's ranks it submits this small job: it
joins the cluster as a driver (``RAY_ADDRESS``, which Ray sets for a job), finds
the run's node agents by the names its supervisor gave them
(``placement.name_agents``), asks each for its ranks' stacks as the run's own
caller would (``run_loop.agents_stacks``: py-spy or a signal on each node), and
prints them as one JSON line after :data:`MARK`, which the follower reads back
from this job's log.
"""

from __future__ import annotations

import json
import sys

MARK = "air_magic stacks: "  # the line of the helper job's log that holds the stacks


def main(argv: list[str]) -> int:
    from air_magic.backends.ray import cluster, placement
    from air_magic.backends.ray.run_loop import agents_stacks

    call_id = argv[0]
    ray = cluster.connect()
    agents = placement.named_agents(ray, call_id)
    stacks = agents_stacks(ray, agents, call_id) if agents else {}
    print(MARK + json.dumps({str(rank): text for rank, text in sorted(stacks.items())}), flush=True)
    return 0


def parse(log: str) -> dict[int, str] | None:
    """The stacks in a helper job's log; None if it printed none (it failed: the log says why)."""
    for line in reversed(log.splitlines()):
        if line.startswith(MARK):
            return {int(rank): text for rank, text in json.loads(line[len(MARK) :]).items()}
    return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
