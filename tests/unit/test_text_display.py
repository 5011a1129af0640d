"""The text display (CLI, scripts, frontends without widgets): few ranks every line, many ranks a summary."""

from __future__ import annotations

import io

from air_magic.display.text import MANY_RANKS, TextDisplay
from air_magic.protocol.events import Outcome, RankExited, RankOutput, RankState, RunFinished, RunStarted


def _shown(
    world: int, failed: int | None, ranks: set[int] | None = None, per_node: int = 0
) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    display = TextDisplay(out=out, err=err, ranks=ranks)
    nodes = (per_node,) * (world // per_node) if per_node else ()
    display.handle(RunStarted("r", world, "gloo", "cpu", False, "/logs", "train", nodes))
    for rank in range(world):
        display.handle(RankOutput(rank, "stdout", "".join(f"rank {rank} step {i}\n" for i in range(30))))
    for rank in range(world):
        if rank == failed:
            state, reason = RankState.FAILED, "raised an exception"
        elif failed is not None and rank % 3 == 0 and rank != 0:
            state, reason = RankState.FAILED, "raised an exception"  # a peer's collateral error
        elif failed is not None:
            state, reason = RankState.KILLED, "stopped by air_magic"
        else:
            state, reason = RankState.SUCCEEDED, "returned"
        display.handle(RankExited(rank, state, 1 if state is RankState.FAILED else 0, reason))
    outcome = Outcome.FAILED if failed is not None else Outcome.SUCCEEDED
    display.handle(RunFinished("r", outcome, 1.0, "/logs", failed_rank=failed))
    return out.getvalue(), err.getvalue()


def test_few_ranks_show_every_line():
    out, err = _shown(MANY_RANKS, failed=None)
    assert out.count("\n") == MANY_RANKS * 30 and "[rank 15] rank 15 step 29" in out
    assert "ranks:" not in err


def test_many_ranks_show_rank_0_the_root_causes_last_lines_and_counts():
    world = 1000
    out, err = _shown(world, failed=737, per_node=8)
    assert out.count("\n") == 30 and all(line.startswith("[rank   0] ") for line in out.splitlines())
    assert "1000 ranks: the console shows rank 0's output" in err and "/logs" in err
    assert "rank 737 failed first; its last lines:" in err
    tail = [line for line in err.splitlines() if line.startswith("[rank 737]")]
    assert tail == [f"[rank 737] rank 737 step {i}" for i in range(10, 30)]  # its last 20 lines
    assert {line.split("]")[0] for line in err.splitlines() if line.startswith("[rank")} == {"[rank 737"}
    failed = 1 + len([r for r in range(1, world) if r % 3 == 0 and r != 737])
    assert f"ranks on 125 nodes: {world - failed} killed (stopped by air_magic), {failed} failed" in err
    # Which nodes the failures were on, most first (a bad node stands out): ten at most.
    assert "; failed by node: node 1: 3, node 3: 3, node 4: 3," in err
    assert err.count("node ") == 10  # ten nodes named ("125 nodes" has no space after it)


def test_many_ranks_that_succeed_are_counted_and_chosen_ranks_are_kept():
    out, err = _shown(64, failed=None)
    assert "air_magic: ranks: 64 succeeded" in err and out.count("\n") == 30
    out, err = _shown(64, failed=None, ranks={5, 6})  # --local-ranks-filter: the user's choice
    assert out.count("\n") == 60 and "ranks:" not in err


def test_the_cpu_mode_line_is_true_for_code_that_calls_air_magics_init_process_group(monkeypatch):
    """Issue 48 #21: the line told code that already calls air_magic.init_process_group() to use
    init_process_group('gloo'); it says what runs, and that only code asking for NCCL must change."""
    monkeypatch.setattr("air_magic.display.text._cpu_mode_said", False)
    err = io.StringIO()
    display = TextDisplay(out=io.StringIO(), err=err)
    display.handle(RunStarted("r", 2, "gloo", "no NVIDIA GPU (CPU mode)", True, "/logs", "train"))
    (line,) = [line for line in err.getvalue().splitlines() if "CPU mode" in line]
    assert "use init_process_group('gloo')" not in line
    assert "on the CPU with gloo" in line and "air_magic.init_process_group() picks it" in line
    assert "asks for 'nccl'" in line
