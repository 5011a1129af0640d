"""How soon a failure among many real ranks ends the call with its root cause named (issue 34, item 5).

    python benchmarks/root_cause_time.py [--no-gloo] 8 64 128 256

Per rank count: a call of warm CPU ranks that join gloo and pass a barrier (not with --no-gloo);
rank 5N/9 then raises while every other rank sleeps. Reported: the rank the call names as the root
cause, the time from that rank's exit event to the call's end (every other rank stopped, the error
built), and from the last rank's exit to the end; how soon the others exited after the failed one,
and how (the stop's SIGTERM, or SIGKILL when its 3 s grace ran out).
"""

from __future__ import annotations

import collections
import inspect
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from air_magic.calls.call import run_call
from air_magic.launch.settings import make_settings
from air_magic.protocol.events import Event, RankExited, RankState, RunFinished


def work(gloo: bool) -> None:
    import os
    import time

    import torch.distributed as dist

    if gloo:
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
        self.others: list[tuple[float, int | None]] = []  # (exit time, exit code) after the failure

    def handle(self, event: Event) -> None:
        now = time.monotonic()
        if isinstance(event, RankExited):
            self.last_exit = now
            if event.state is RankState.FAILED and self.failed_at is None:
                self.failed_at = now
            elif self.failed_at is not None:
                self.others.append((now - self.failed_at, event.exit_code))
        elif isinstance(event, RunFinished):
            self.end, self.root_cause = now, event.failed_rank


def main() -> None:
    gloo = "--no-gloo" not in sys.argv  # without it: what gloo's connections add to the stop
    for ranks in [int(a) for a in sys.argv[1:] if a != "--no-gloo"] or [8, 64, 128, 256]:
        probe = Probe()
        settings = make_settings(num_accelerators=ranks, display="none", tracking=False)
        result = run_call("work", work, inspect.signature(work).bind(gloo), settings, consumers=[probe])
        row = {
            "ranks": ranks,
            "gloo": gloo,
            "root_cause": probe.root_cause,
            "failed_exit_to_end_s": round(probe.end - (probe.failed_at or probe.end), 3),
            "last_exit_to_end_s": round(probe.end - probe.last_exit, 3),
            # How the other ranks went: their exits after the failed one's (p50, max) and by what
            # exit code (-15: the stop's SIGTERM; -9: still there when its grace ran out).
            "others_exit_s_p50_max": _p50_max([t for t, _ in probe.others]),
            "others_by_exit_code": dict(collections.Counter(str(c) for _, c in probe.others)),
            "error": str(result.error).splitlines()[0][:80],
        }
        print(json.dumps(row), flush=True)


def _p50_max(values: list[float]) -> list[float]:
    values = sorted(values)
    return [round(values[len(values) // 2], 3), round(values[-1], 3)] if values else []


if __name__ == "__main__":
    main()
