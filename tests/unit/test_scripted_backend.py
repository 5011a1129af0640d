"""The scripted backend (backends/scripted.py): each way a script makes a rank end, as a call sees it.

Each call goes through the call layer (``calls.call.run_call``) as a user's would, with the
backend handed in; what the ranks do is the script's, everything after them is real.
"""

from __future__ import annotations

import inspect
import os
import signal
import threading

import pytest
from helpers.recording import Recorder

from air_magic import paths
from air_magic.backends import scripted
from air_magic.backends.output import KEEP_RUNS
from air_magic.backends.scripted import FIRST_PID, Rank, ScriptedBackend
from air_magic.calls.call import run_call
from air_magic.calls.history import read_summaries
from air_magic.calls.persistent import Session
from air_magic.errors import (
    ConfigurationError,
    DistributedTimeoutError,
    LaunchError,
    PayloadError,
    RankFailedError,
)
from air_magic.launch.request import RunResult
from air_magic.launch.settings import make_settings
from air_magic.protocol.events import RankExited, RankOutput, RankStarted, RankState, RunStarted


def train():
    """Never runs: the script says what each rank does."""


def play(backend: ScriptedBackend, recorder: Recorder | None = None, **settings) -> RunResult:
    settings.setdefault("display", "none")
    settings.setdefault("tracking", False)
    kind = settings.pop("kind", "function")
    made = make_settings(**settings)
    consumers = [recorder] if recorder is not None else []
    bound = inspect.signature(train).bind()
    return run_call("train", train, bound, made, backend=backend, consumers=consumers, kind=kind)


class Diverged(ValueError):
    pass


def test_each_rank_returns_its_value_in_rank_order():
    recorder = Recorder()
    result = play(ScriptedBackend([Rank(returns={"loss": 0.5}), Rank(returns=[1, 2])]), recorder)
    assert (result.outcome, result.values) == ("succeeded", [{"loss": 0.5}, [1, 2]])
    (started,) = recorder.of(RunStarted)
    assert (started.world_size, started.name, started.cpu_mode) == (2, "train", True)
    assert [(e.rank, e.pid) for e in recorder.of(RankStarted)] == [(0, FIRST_PID), (1, FIRST_PID + 1)]
    assert recorder.exits() == {0: (RankState.SUCCEEDED, "returned"), 1: (RankState.SUCCEEDED, "returned")}


def test_a_rank_without_an_ending_returns_none():
    assert play(ScriptedBackend([Rank(), Rank(prints=["hello"])])).values == [None, None]


def test_lines_reach_the_events_and_the_ranks_logs():
    recorder = Recorder()
    script = [Rank(prints=["step 1", "step 2"], stderr=["a warning"]), Rank()]
    result = play(ScriptedBackend(script), recorder)
    shown = [(e.rank, e.stream, e.text) for e in recorder.of(RankOutput)]
    assert shown == [(0, "stdout", "step 1\nstep 2\n"), (0, "stderr", "a warning\n")]
    with open(paths.rank_log(result.log_dir, 0)) as f:
        assert f.read().splitlines() == ["step 1", "step 2", "a warning"]


def test_prints_may_be_one_string_of_lines():
    assert Rank(prints="one\ntwo", stderr="three").prints == ("one", "two")
    assert Rank(stderr="three").stderr == ("three",)


def test_a_raised_exception_comes_back_as_itself_with_the_ranks_traceback():
    recorder = Recorder()
    script = [Rank(hangs=True), Rank(prints=["step 7"], raises=Diverged("loss is nan"))]
    with pytest.raises(Diverged) as caught:
        play(ScriptedBackend(script), recorder).unwrap()
    assert (str(caught.value), caught.value.air_magic_rank) == ("loss is nan", 1)
    cause = str(caught.value.__cause__)
    assert 'File "<scripted rank 1>", line 1, in train' in cause and "Diverged: loss is nan" in cause
    stderr = "".join(e.text for e in recorder.of(RankOutput) if e.stream == "stderr")
    assert stderr.startswith("Traceback (most recent call last):")  # as a rank writes it, to its log
    assert recorder.exits()[0] == (RankState.KILLED, "stopped by air_magic")


def _deep_in_the_loader():
    raise Diverged("bad batch")


def test_an_exception_raised_for_real_keeps_its_own_frames():
    try:
        _deep_in_the_loader()
    except Diverged as exc:
        raised = exc
    with pytest.raises(Diverged) as caught:
        play(ScriptedBackend([Rank(raises=raised), Rank()])).unwrap()
    assert "in _deep_in_the_loader" in str(caught.value.__cause__)


class Unrebuildable(Exception):
    def __init__(self, code: int, why: str):  # pickles, but cannot be rebuilt from its args
        super().__init__(f"{code}: {why}")


def test_an_exception_that_cannot_travel_comes_back_in_words():
    with pytest.raises(RankFailedError) as caught:
        play(ScriptedBackend([Rank(raises=Unrebuildable(3, "odd")), Rank()])).unwrap()
    assert caught.value.rank == 0 and "Unrebuildable" in str(caught.value) and "3: odd" in str(caught.value)


def test_a_value_that_cannot_be_sent_back_fails_as_a_ranks_would():
    with pytest.raises(PayloadError, match="rank 1's return value cannot be sent back"):
        play(ScriptedBackend([Rank(), Rank(returns=threading.Lock())])).unwrap()


@pytest.mark.parametrize(
    ("signum", "hint"), [(signal.SIGKILL, "out-of-memory killer"), (signal.SIGSEGV, "native code")]
)
def test_a_rank_killed_by_a_signal_is_named_with_it_and_its_last_lines(signum, hint):
    script = [Rank(hangs=True), Rank(prints=["allocating"], killed_by=signum)]
    with pytest.raises(RankFailedError) as caught:
        play(ScriptedBackend(script)).unwrap()
    text = str(caught.value)
    assert caught.value.rank == 1 and f"killed by {signal.Signals(signum).name}" in text
    assert hint in text and "allocating" in text


def test_an_exit_status_without_a_result():
    with pytest.raises(RankFailedError, match="exited with status 3"):
        play(ScriptedBackend([Rank(exits=3), Rank(hangs=True)])).unwrap()
    with pytest.raises(RankFailedError, match="exited with status 0 without returning a result"):
        play(ScriptedBackend([Rank(exits=0), Rank()])).unwrap()
    # A script's rank (air-magic run) succeeds with exit status 0 alone, as under torchrun.
    assert play(ScriptedBackend([Rank(exits=0), Rank(exits=0)]), kind="script").values == [None, None]


def test_ranks_end_in_the_order_of_at():
    recorder = Recorder()
    play(ScriptedBackend([Rank(at=0.3), Rank(at=0.1), Rank(at=0.2)]), recorder)
    assert [e.rank for e in recorder.of(RankExited)] == [1, 2, 0]


def test_a_hanging_rank_runs_until_the_timeout_with_its_stack_in_the_error():
    script = [Rank(prints=["epoch 3"], hangs=True), Rank(returns=1)]
    with pytest.raises(DistributedTimeoutError) as caught:
        play(ScriptedBackend(script), timeout=0.2).unwrap()
    text = str(caught.value)
    assert caught.value.still_running == [0] and "rank 0 was still running; its last lines:" in text
    assert 'File "<scripted rank 0>", line 1 in train' in text  # what it was doing


def test_a_rank_stuck_exiting_after_it_returned_is_said_so():
    with pytest.raises(DistributedTimeoutError, match="rank 1 had returned but was still exiting"):
        play(ScriptedBackend([Rank(), Rank(returns=1, stuck_exiting=True)]), timeout=0.2).unwrap()


class WatchesRunning(Recorder):
    """Asks the backend what runs as the ranks start and end."""

    def __init__(self, backend: ScriptedBackend):
        super().__init__()
        self.backend = backend
        self.seen: list[tuple[list[int], list[int]]] = []

    def handle(self, event: object) -> None:
        super().handle(event)
        if isinstance(event, RankStarted | RankExited):
            self.seen.append((self.backend.running(), sorted(self.backend.stacks())))


def test_running_and_stacks_follow_the_call_and_are_empty_between_calls():
    backend = ScriptedBackend([Rank(at=0.1), Rank(at=0.2)])
    watcher = WatchesRunning(backend)
    play(backend, watcher)
    # rank 0 started (rank 1 not yet), both running, rank 0 ended, rank 1 ended
    assert watcher.seen == [([0], [0, 1]), ([0, 1], [0, 1]), ([1], [1]), ([], [])]
    assert backend.running() == [] and backend.stacks() == {}


def test_a_script_per_call_chosen_from_the_request():
    scripts = {"train": lambda world: [Rank(returns=f"train {r}/{world}") for r in range(world)]}
    backend = ScriptedBackend(lambda request: scripts[request.name](request.plan.world_size))
    assert play(backend, num_accelerators=3).values == ["train 0/3", "train 1/3", "train 2/3"]
    assert play(backend).values == ["train 0/2", "train 1/2"]  # the CPU's default: 2 ranks


def test_a_script_that_does_not_fit_the_call_is_refused():
    with pytest.raises(ConfigurationError, match="num_accelerators=3, but the script has 2 rank"):
        play(ScriptedBackend([Rank(), Rank()]), num_accelerators=3)
    with pytest.raises(LaunchError, match="the script has 2 rank"):
        play(ScriptedBackend([Rank(), Rank()], nodes=[1, 2]))


@pytest.mark.parametrize(
    "rank",
    [
        lambda: Rank(returns=1, raises=ValueError()),
        lambda: Rank(hangs=True, killed_by=signal.SIGKILL),
        lambda: Rank(exits=0, stuck_exiting=True),
        lambda: Rank(hangs=True, seen_late=True),
    ],
    ids=["two endings", "hangs and killed", "stuck after an exit", "late and hanging"],
)
def test_a_rank_has_one_ending(rank):
    with pytest.raises(ConfigurationError):
        rank()


def test_ranks_on_several_nodes():
    recorder = Recorder()
    script = [Rank(), Rank(), Rank(), Rank(raises=Diverged("on node 1"))]
    with pytest.raises(Diverged):
        play(ScriptedBackend(script, nodes=[2, 2]), recorder).unwrap()
    (started,) = recorder.of(RunStarted)
    assert started.ranks_per_node == (2, 2) and started.node_of() == [0, 0, 1, 1]


class StopsOnceAllRun(Recorder):
    def __init__(self, backend: ScriptedBackend):
        super().__init__()
        self.backend = backend

    def handle(self, event: object) -> None:
        super().handle(event)
        if isinstance(event, RankStarted) and len(self.backend.running()) == 2:
            self.backend.stop(grace_s=5.0)


def test_the_backend_serves_the_next_call_after_a_stop():
    backend = ScriptedBackend([Rank(hangs=True), Rank(hangs=True)])
    assert play(backend, StopsOnceAllRun(backend), stop_grace=20).outcome == "interrupted"
    assert backend.stops == [(5.0, signal.SIGINT)]  # the shorter grace asked, and Ctrl-C's signal
    backend.ranks = [Rank(returns=0), Rank(returns=1)]
    assert play(backend).values == [0, 1] and backend.stops == []


def test_a_call_leaves_only_its_log_folder():
    folder = play(ScriptedBackend([Rank(prints=["x"]), Rank()])).log_dir
    made = {paths.run_summary(folder), paths.rank_log(folder, 0), paths.rank_log(folder, 1)}
    assert {os.path.join(folder, name) for name in os.listdir(folder)} == made


def test_a_call_without_log_dir_stays_out_of_the_run_history(tmp_path, monkeypatch):
    history = tmp_path / "runs"  # the default log root, as AIR_MAGIC_LOG_DIR moves it
    monkeypatch.setenv("AIR_MAGIC_LOG_DIR", str(history))
    assert paths.default_log_root() == str(history)
    kept = [history / f"20000101-000000-{n:06x}" for n in range(KEEP_RUNS)]  # a full history, oldest first
    for folder in kept:
        folder.mkdir(parents=True)
    result = play(ScriptedBackend([Rank(prints=["x"]), Rank(raises=Diverged("nan"))]))
    assert result.outcome == "failed" and os.path.isfile(paths.rank_log(result.log_dir, 0))
    assert os.path.dirname(result.log_dir) == os.path.realpath(scripted.log_root())  # this process's
    session = Session(
        make_settings(num_accelerators=1, display="none", tracking=False), backend=ScriptedBackend([Rank()])
    )
    session.start().stop(quiet=True)
    assert os.path.dirname(session.log_dir) == os.path.dirname(result.log_dir)  # a session's too
    assert sorted(os.listdir(history)) == [f.name for f in kept]  # nothing added, the oldest not pruned
    assert [s["outcome"] for s in read_summaries(str(history))] == ["unknown"] * KEEP_RUNS  # `air-magic runs`


def test_a_call_with_log_dir_logs_there(tmp_path, monkeypatch):
    monkeypatch.setenv("AIR_MAGIC_LOG_DIR", str(tmp_path / "runs"))
    result = play(ScriptedBackend([Rank(returns=1)]), log_dir=str(tmp_path / "mine"))
    assert os.path.dirname(result.log_dir) == os.path.realpath(tmp_path / "mine")
    (summary,) = read_summaries(str(tmp_path / "mine"))
    assert (summary["run_id"], summary["outcome"]) == (result.call_id, "succeeded")
    assert not os.path.exists(tmp_path / "runs")
