"""A call's rules as its user sees them, with scripted ranks (backends/scripted.py): no process.

The root cause among several failing ranks, the timeout's text, a stop, what the text display
prints for a call that failed, and what the run history (``last_run()``, run.json) keeps: each
through the call layer (``calls.call.run_call``), its consumers and the real call loop.
"""

from __future__ import annotations

import inspect
import io
import signal

import pytest
from helpers.recording import Recorder

from air_magic.backends.scripted import Rank, ScriptedBackend
from air_magic.calls.call import run_call
from air_magic.calls.history import last_run, read_summaries
from air_magic.display.text import TextDisplay
from air_magic.errors import DistributedTimeoutError, LaunchError, RankFailedError
from air_magic.launch.request import RunResult
from air_magic.launch.settings import make_settings
from air_magic.protocol.events import RankStarted, RankState, RunFinished


def train():
    """Never runs: the script says what each rank does."""


def play(*ranks: Rank, consumers=(), **settings) -> RunResult:
    settings.setdefault("display", "none")
    settings.setdefault("tracking", False)
    backend = ScriptedBackend(list(ranks))
    made = make_settings(**settings)
    bound = inspect.signature(train).bind()
    return run_call("train", train, bound, made, backend=backend, consumers=[c(backend) for c in consumers])


class Diverged(ValueError):
    pass


GLOO_RESET = "[../gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"

# -- the root cause ----------------------------------------------------------------------------


def several_failing() -> list[Rank]:
    """Ranks 0, 1 and 2 raise their own errors at 0.3, 0.2 and 0.1 s; rank 3 is still training."""
    return [
        Rank(prints=["rank 0 step 9"], raises=Diverged("rank 0's own"), at=0.3),
        Rank(prints=["rank 1 step 9"], raises=Diverged("rank 1's own"), at=0.2),
        Rank(prints=["rank 2 step 9"], raises=Diverged("rank 2's own"), at=0.1),
        Rank(prints=["rank 3 step 9"], hangs=True),
    ]


def test_the_earliest_failure_is_the_exception_raised():
    with pytest.raises(Diverged) as caught:
        play(*several_failing()).unwrap()
    assert str(caught.value) == "rank 2's own" and caught.value.air_magic_rank == 2
    assert [rank for rank, _, _ in caught.value.air_magic_failures] == [2, 1, 0]


def test_the_others_are_named_in_a_note_after_the_root_cause():
    with pytest.raises(Diverged) as caught:
        play(*several_failing()).unwrap()
    where, others = caught.value.__notes__
    assert where.startswith("[air_magic] raised on rank 2 of 4; full log: ") and where.endswith("rank-2.log")
    assert others == (
        "[air_magic] after it, 2 other rank(s) failed too: rank 1: Diverged: rank 1's own; "
        "rank 0: Diverged: rank 0's own"
    )


def test_the_root_cause_is_the_failed_rank_of_run_finished_and_of_history():
    recorder = Recorder()
    play(*several_failing(), consumers=[lambda _: recorder])
    (finished,) = recorder.of(RunFinished)
    assert finished.outcome == "failed" and finished.failed_rank == 2
    assert finished.error is not None and finished.error.startswith("Diverged: rank 2's own")
    run = last_run()
    assert run.outcome == "failed" and run.error == finished.error
    assert run.rank_states == {2: "failed", 1: "failed", 0: "failed", 3: "killed"}


def test_a_ranks_own_error_comes_before_its_peers_earlier_collective_errors():
    ranks = [
        Rank(raises=RuntimeError(GLOO_RESET), at=0.1),
        Rank(raises=Diverged("nan in the loss"), at=0.5),
        Rank(raises=RuntimeError(GLOO_RESET), at=0.1),
    ]
    with pytest.raises(Diverged) as caught:
        play(*ranks).unwrap()
    assert caught.value.air_magic_rank == 1
    assert [rank for rank, _, _ in caught.value.air_magic_failures] == [1, 0, 2]


@pytest.mark.parametrize(("killed_at", "root"), [(1.0, 1), (2.0, 0)])
def test_a_sigkill_seen_soon_after_an_exception_came_first(killed_at, root):
    # A SIGKILL is only seen after the fact: within 1.5 s of the earliest exception it counts as
    # earlier (nothing a peer raises SIGKILLs a rank); later, time decides.
    ranks = [
        Rank(raises=Diverged("a peer vanished?"), at=0.5),
        Rank(killed_by=signal.SIGKILL, at=0.5 + killed_at),
    ]
    recorder = Recorder()
    result = play(*ranks, consumers=[lambda _: recorder])
    assert recorder.of(RunFinished)[0].failed_rank == root
    assert type(result.error) is (RankFailedError if root == 1 else Diverged)


def test_one_failing_rank_among_many_is_named_in_history_and_the_display():
    world, failing = 40, 29
    ranks = [Rank(prints=[f"rank {r} step 1"], hangs=True) for r in range(world)]
    ranks[failing] = Rank(prints=["loading shard 29", "shard 29 is corrupt"], raises=Diverged("bad shard"))
    err = io.StringIO()
    play(*ranks, consumers=[lambda _: TextDisplay(out=io.StringIO(), err=err)])
    text = err.getvalue()
    assert "rank 29 failed first; its last lines:" in text
    assert "[rank 29] shard 29 is corrupt" in text
    assert "ranks: 39 killed (stopped by air_magic), 1 failed" in text
    assert last_run().rank_states[failing] == "failed"


# -- the timeout -------------------------------------------------------------------------------


def test_the_timeout_names_the_ranks_still_running_with_their_last_five_lines():
    ranks = [Rank(returns=0), Rank(prints=[f"step {i}" for i in range(1, 9)], hangs=True)]
    with pytest.raises(DistributedTimeoutError) as caught:
        play(*ranks, timeout=0.2).unwrap()
    text = str(caught.value)
    assert text.startswith("timed out after 0.2 s (timeout=0.2); every rank was stopped.\n")
    assert (
        "rank 1 was still running; its last lines:\n" + "\n".join(f"      step {i}" for i in range(4, 9))
        in text
    )
    assert "step 3" not in text and "rank 0 " not in text  # rank 0 had returned: not in the text
    assert caught.value.still_running == [1] and text.endswith(f"  Logs: {caught.value.log_dir}")


def test_a_rank_that_printed_nothing_says_so_at_the_timeout():
    with pytest.raises(
        DistributedTimeoutError, match=r"rank 0 was still running; its last lines:\n.*nothing printed"
    ):
        play(Rank(hangs=True), Rank(), timeout=0.2).unwrap()


def test_a_timeout_is_the_outcome_of_history_and_the_display():
    err = io.StringIO()
    play(
        Rank(hangs=True), Rank(hangs=True), timeout=0.2, consumers=[lambda _: TextDisplay(io.StringIO(), err)]
    )
    run = last_run()
    assert run.outcome == "timeout" and run.error.startswith("DistributedTimeoutError: timed out after 0.2 s")
    assert set(run.rank_states.values()) == {"killed"}
    assert "air_magic: rank 0 killed: stopped by air_magic" in err.getvalue()
    assert "air_magic: timeout in " in err.getvalue()


# -- a stop ------------------------------------------------------------------------------------


class StopsOnceRunning(Recorder):
    def __init__(self, backend: ScriptedBackend):
        super().__init__()
        self.backend = backend

    def handle(self, event: object) -> None:
        super().handle(event)
        if isinstance(event, RankStarted) and event.rank == 1:  # as the stop button, from anywhere
            self.backend.stop()


def test_a_stop_ends_the_call_interrupted_and_every_rank_killed():
    result = play(Rank(prints=["step 1"], hangs=True), Rank(hangs=True), consumers=[StopsOnceRunning])
    assert result.outcome == "interrupted"
    with pytest.raises(LaunchError, match=r"^train was stopped before it finished; every rank is gone$"):
        result.unwrap()
    run = last_run()
    assert run.outcome == "interrupted" and run.rank_states == {0: "killed", 1: "killed"}
    assert run.error == "LaunchError: train was stopped before it finished; every rank is gone"


def test_a_stop_wins_over_a_failure_not_yet_seen_which_is_still_told():
    # The stop comes as the ranks start, before rank 0's error reaches the loop: the call was
    # stopped (its outcome), and rank 0 still failed on its own (its state), not by the stop.
    result = play(Rank(raises=Diverged("on its way")), Rank(hangs=True), consumers=[StopsOnceRunning])
    assert result.outcome == "interrupted" and isinstance(result.error, LaunchError)
    assert last_run().rank_states == {0: "failed", 1: "killed"}


# -- the text display --------------------------------------------------------------------------


def said(err: io.StringIO) -> list[str]:
    """The display's lines on stderr, but the CPU mode's (said once a process)."""
    return [line for line in err.getvalue().splitlines() if "CPU mode" not in line]


def test_the_text_display_shows_a_failed_call_rank_by_rank():
    out, err = io.StringIO(), io.StringIO()
    ranks = [Rank(prints="epoch 1", hangs=True), Rank(prints="epoch 1\nepoch 2", raises=Diverged("nan"))]
    play(*ranks, consumers=[lambda _: TextDisplay(out=out, err=err)])
    assert out.getvalue().splitlines() == ["[rank 0] epoch 1", "[rank 1] epoch 1", "[rank 1] epoch 2"]
    *lines, end = said(err)
    assert lines == [
        "air_magic: running train on 2 rank(s), backend gloo",
        "[rank 1] Traceback (most recent call last):",
        '[rank 1]   File "<scripted rank 1>", line 1, in train',
        f"[rank 1] {Diverged.__module__}.Diverged: nan",
        "air_magic: rank 1 failed: raised an exception",
        "air_magic: rank 0 killed: stopped by air_magic",
    ]
    assert end.startswith("air_magic: failed in ") and end.endswith(f" s; logs: {last_run().log_dir}")


def test_the_text_display_of_a_success_says_nothing_of_the_ranks():
    err = io.StringIO()
    play(Rank(prints=["done"]), Rank(), consumers=[lambda _: TextDisplay(out=io.StringIO(), err=err)])
    assert "rank 0" not in err.getvalue() and "air_magic: succeeded in " in err.getvalue()


# -- the run history ---------------------------------------------------------------------------


def test_history_keeps_each_ranks_state_and_exit_code():
    with pytest.raises(RankFailedError):
        play(Rank(hangs=True), Rank(killed_by=signal.SIGKILL)).unwrap()
    run = last_run()
    assert (run.name, run.world_size, run.outcome) == ("train", 2, "failed")
    assert run.rank_exit_codes == {1: -signal.SIGKILL, 0: -signal.SIGTERM}
    assert run.rank_states == {1: "failed", 0: "killed"}
    assert run.error.startswith("RankFailedError: rank 1 of 2 was killed by SIGKILL")
    assert run.elapsed is not None and run.elapsed < 10


def test_history_points_at_each_ranks_log():
    play(Rank(prints=["hello from 0"]), Rank(stderr=["warned by 1"]))
    run = last_run()
    with open(run.log_path(0)) as f0, open(run.log_path(1)) as f1:
        assert (f0.read(), f1.read()) == ("hello from 0\n", "warned by 1\n")


def test_run_json_says_the_outcome_to_other_processes(tmp_path):
    with pytest.raises(Diverged):
        play(Rank(raises=Diverged("nan")), Rank(), log_dir=str(tmp_path)).unwrap()
    (summary,) = read_summaries(str(tmp_path))
    assert (summary["name"], summary["outcome"], summary["world_size"]) == ("train", "failed", 2)
    assert summary["rank_states"] == {"0": "failed", "1": "succeeded"}
    assert summary["error"].startswith("Diverged: nan") and summary["run_id"] == last_run().call_id
    assert last_run().run_id == last_run().call_id  # the former name, still read


def test_a_ranks_states_are_the_bus_events_in_the_order_they_ended():
    recorder = Recorder()
    play(Rank(at=0.2), Rank(raises=Diverged("x"), at=0.1), Rank(hangs=True), consumers=[lambda _: recorder])
    exits = recorder.exits()
    assert list(exits) == [1, 0, 2]  # rank 0 ended on its own after rank 1: everything scripted happens
    assert exits == {
        1: (RankState.FAILED, "raised an exception"),
        0: (RankState.SUCCEEDED, "returned"),
        2: (RankState.KILLED, "stopped by air_magic"),
    }
