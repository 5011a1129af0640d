"""How soon a failure among many real ranks ends the call with its root cause named (issue 34, item 5).

    python benchmarks/root_cause_time.py 8 64 128 256

Per rank count: a call of warm CPU ranks that join gloo and pass a barrier; rank 5N/9 then raises
while every other rank sleeps. Reported: the rank the call names as the root cause, the time from
that rank's exit event to the call's end (every other rank stopped, the error built), and from the
last rank's exit to the end.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from air_magic.calls.call import run_call
from air_magic.launch.settings import make_settings
from air_magic.protocol.events import Event, RankExited, RankState, RunFinished


def work() -> None:
    import os
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    if os.environ["RANK"] == str(int(os.environ["WORLD_SIZE"]) * 5 // 9):
        time.sleep(1)
        raise ValueError("bad shard")
    time.sleep(60)


class Probe:
    def __init__(self) -> None:
        self.failed_at: float | None = None
        self.last_exit = self.end = 0.0
        self.root_cause: int | None = None

    def handle(self, event: Event) -> None:
        now = time.monotonic()
        if isinstance(event, RankExited):
            self.last_exit = now
            if event.state is RankState.FAILED and self.failed_at is None:
                self.failed_at = now
        elif isinstance(event, RunFinished):
            self.end, self.root_cause = now, event.failed_rank


def main() -> None:
    for ranks in [int(a) for a in sys.argv[1:]] or [8, 64, 128, 256]:
        probe = Probe()
        settings = make_settings(num_accelerators=ranks, display="none", tracking=False)
        result = run_call("work", work, inspect.signature(work).bind(), settings, consumers=[probe])
        row = {
            "ranks": ranks,
            "root_cause": probe.root_cause,
            "failed_exit_to_end_s": round(probe.end - (probe.failed_at or probe.end), 3),
            "last_exit_to_end_s": round(probe.end - probe.last_exit, 3),
            "error": str(result.error).splitlines()[0][:80],
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
