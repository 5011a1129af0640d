"""The one outcome rule, driven by scripted ranks: the public fake backend, no process started.

``outcome/ledger.py`` decides how each rank ended and what the call's outcome is,
``outcome/failures.root_cause_order`` which failure is the root cause, and
``backends/call_loop.CallLoop`` is the template every backend runs. Here
``backends/scripted.ScriptedBackend`` plays each rank's script through that
template as a backend's rank groups would report it, so each rule is checked in
milliseconds; the real processes check the same rules in the contract suite
(tests/contract/test_backend_contract.py, where the scripted backend is a row too).
"""

from __future__ import annotations

import pickle
import signal
import time

import pytest
from helpers.recording import Recorder

from air_magic.backends.call_loop import GRACE_S
from air_magic.backends.scripted import Rank, ScriptedBackend
from air_magic.errors import DistributedTimeoutError, PayloadError, RankFailedError
from air_magic.launch.accelerators import AcceleratorPlan
from air_magic.launch.request import LaunchRequest, RunResult
from air_magic.outcome.failures import RankFailure, root_cause_order
from air_magic.outcome.ledger import CallLedger, RankRecord, classify_exit, timeout_error
from air_magic.protocol import serialization
from air_magic.protocol.events import EventBus, RankMetrics, RankStarted, RankState, RunFinished
from air_magic.protocol.node_events import Exited, GroupDone, Metrics, NodeLost
from air_magic.protocol.wire import ErrorRecord


def request(world: int = 2, **kw) -> LaunchRequest:
    plan = AcceleratorPlan(world_size=world, gpus=(), detected="no NVIDIA GPU (CPU mode)")
    kw.setdefault("log_root", _log_root)
    return LaunchRequest(name="train", payload=b"", plan=plan, timeout=kw.pop("timeout", None), **kw)


_log_root: str | None = None


@pytest.fixture(autouse=True)
def _logs_in(tmp_path):
    """Each test's call folders under its own tmp_path."""
    global _log_root
    _log_root = str(tmp_path)
    yield
    _log_root = None


class Played:
    """One scripted call: its result, its events, the backend (its stops)."""

    def __init__(self, *ranks: Rank, nodes: list[int] | None = None, consumers=(), **kw):
        self.backend = ScriptedBackend(list(ranks), nodes=nodes)
        self.recorder = Recorder()
        bus = EventBus([self.recorder, *(c(self.backend) for c in consumers)])
        self.result: RunResult = self.backend.run(request(len(ranks), **kw), bus)

    @property
    def failed_rank(self) -> int | None:
        (finished,) = self.recorder.of(RunFinished)
        return finished.failed_rank


def record(rank: int, when: float, exc: BaseException) -> bytes:
    return serialization.dumps(
        ErrorRecord(
            rank=rank,
            time=when,
            stage="run",
            type_name=f"{type(exc).__module__}.{type(exc).__qualname__}",
            message=str(exc),
            traceback=f'Traceback (most recent call last):\n  File "train.py", line 3\n{exc!r}\n',
            exception=pickle.dumps(exc),
        )
    )


def exited(rank: int, code: int | None, when: float, **kw) -> Exited:
    kw.setdefault("result", None)
    kw.setdefault("returned", kw["result"] is not None)
    kw.setdefault("error", None)
    kw.setdefault("status_lost", False)
    kw.setdefault("teardown_at", None)
    return Exited(rank, code, when, **kw)


class DivergedError(ValueError):
    pass


def _refuse_to_load():
    raise RuntimeError("this value loads only in the rank")


class LoadsOnlyInTheRank:
    def __reduce__(self):
        return (_refuse_to_load, ())


def test_every_rank_returning_gives_the_values_in_rank_order():
    call = Played(Rank(returns="zero", at=1.1), Rank(prints=["hello"], returns="one", at=1.0))
    assert (call.result.outcome, call.result.values) == ("succeeded", ["zero", "one"])
    assert call.recorder.exits() == {
        0: (RankState.SUCCEEDED, "returned"),
        1: (RankState.SUCCEEDED, "returned"),
    }
    assert list(call.recorder.exits()) == [1, 0]  # in the order they ended
    assert call.backend.stops == [] and isinstance(call.recorder.events[-1], RunFinished)


def test_a_result_that_cannot_load_fails_the_call():
    result = Played(Rank(returns=LoadsOnlyInTheRank()), Rank(returns=LoadsOnlyInTheRank())).result
    assert result.outcome == "failed" and isinstance(result.error, PayloadError)
    assert "rank 0's return value could not be loaded" in str(result.error)


def test_a_rank_raising_is_the_root_cause_and_the_others_are_stopped():
    call = Played(Rank(hangs=True), Rank(raises=DivergedError("nan"), at=5.0))
    result = call.result
    assert result.outcome == "failed" and isinstance(result.error, DivergedError)
    assert result.error.air_magic_rank == 1 and call.failed_rank == 1
    assert call.backend.stops == [(GRACE_S, signal.SIGTERM)]
    assert call.recorder.exits() == {
        1: (RankState.FAILED, "raised an exception"),
        0: (RankState.KILLED, "stopped by air_magic"),
    }


def test_a_collateral_error_stamped_first_is_not_the_root_cause():
    # Rank 0's gloo error is stamped before rank 1's own (another node's clock ran ahead):
    # the rank's own failure still comes first.
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4242")
    result = Played(Rank(raises=gloo, at=1.0), Rank(raises=DivergedError("nan"), at=2.0)).result
    assert isinstance(result.error, DivergedError)
    assert [f[0] for f in result.error.air_magic_failures] == [1, 0]


def test_a_rank_sigkilled_but_seen_dead_only_in_the_teardown_is_the_root_cause():
    # Rank 1 was SIGKILLed; its peer's "connection reset" came in first, and its death was seen
    # only after the teardown began (a busy machine), before its grace was over: not our SIGKILL.
    reset = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    call = Played(
        Rank(hangs=True), Rank(killed_by=signal.SIGKILL, seen_late=True), Rank(raises=reset, at=5.0)
    )
    result = call.result
    assert isinstance(result.error, RankFailedError) and call.failed_rank == 1, result.error
    assert "killed by SIGKILL" in str(result.error)
    assert call.recorder.exits() == {
        2: (RankState.FAILED, "raised an exception"),
        1: (RankState.FAILED, "killed by SIGKILL"),
        0: (RankState.KILLED, "stopped by air_magic"),
    }


def test_a_sigkill_seen_late_still_comes_before_the_error_it_caused():
    gloo = serialization.loads(record(0, 10.0, RuntimeError("Connection reset by peer")))
    own = serialization.loads(record(2, 10.2, DivergedError("oom in the loader")))
    killed = RankFailure.of(1, 11.0, -signal.SIGKILL, None)  # its death was seen 1 s after the error
    ordered = root_cause_order([RankFailure.of(0, 10.0, 1, gloo), RankFailure.of(2, 10.2, 1, own), killed])
    assert [f.rank for f in ordered] == [1, 2, 0]
    late = RankFailure.of(3, 30.0, -signal.SIGKILL, None)  # long after: a consequence in time
    assert [f.rank for f in root_cause_order([RankFailure.of(2, 10.2, 1, own), late])] == [2, 3]


def test_exits_after_the_teardown_are_classified_by_their_record():
    req = request()
    cases = {  # what the rank wrote, when (the teardown began at 10.0), it had returned -> how it ended
        "stopped": (None, 0.0, False, (RankState.KILLED, "stopped by air_magic")),
        "interrupted": (
            KeyboardInterrupt(),
            10.1,
            False,
            (RankState.KILLED, "stopped by air_magic (it raised while stopping)"),
        ),
        "raised before": (KeyboardInterrupt(), 9.0, False, (RankState.FAILED, "raised an exception")),
        "its own error": (DivergedError("x"), 10.1, False, (RankState.FAILED, "raised an exception")),
        "returned": (
            None,
            0.0,
            True,
            (RankState.KILLED, "stopped by air_magic after it returned, while it was exiting"),
        ),
    }
    for name, (exc, raised_at, returned, expected) in cases.items():
        r = RankRecord(0, exit_code=-signal.SIGTERM, exit_time=10.2, returned=returned, ended=True)
        r.error = record(0, raised_at, exc) if exc is not None else None
        assert classify_exit(req, r, teardown_at=10.0) == expected, name
    before = RankRecord(0, exit_code=-signal.SIGKILL, exit_time=5.0)
    assert classify_exit(req, before, teardown_at=9.9) == (RankState.FAILED, "killed by SIGKILL")
    # SIGKILLed, seen only once the teardown began (a busy machine) but before its grace was over:
    # not ours (we SIGKILL after the grace), so it died on its own; after the grace, it was ours.
    seen_late = RankRecord(0, exit_code=-signal.SIGKILL, exit_time=10.2)
    assert classify_exit(req, seen_late, 10.0, sigkill_from=13.0) == (RankState.FAILED, "killed by SIGKILL")
    after_grace = RankRecord(0, exit_code=-signal.SIGKILL, exit_time=13.1)
    stopped = (RankState.KILLED, "stopped by air_magic")
    assert classify_exit(req, after_grace, 10.0, sigkill_from=13.0) == stopped
    assert classify_exit(req, seen_late, 10.0) == stopped  # its grace unknown
    assert classify_exit(req, RankRecord(0, exit_code=3), None) == (RankState.FAILED, "exited with status 3")
    script_exit = RankRecord(0, exit_code=3, error=record(0, 1.0, SystemExit(3)))  # a script's sys.exit(3)
    assert classify_exit(req, script_exit, None) == (RankState.FAILED, "exited with status 3")
    script = request(exit_zero_succeeds=True)
    assert classify_exit(script, RankRecord(0, exit_code=0), None)[0] is RankState.SUCCEEDED
    assert classify_exit(req, RankRecord(0, exit_code=0), None) == (
        RankState.FAILED,
        "exited with status 0 without a result",
    )


def test_a_reported_error_fails_the_call_while_the_rank_is_still_exiting():
    # The rank wrote its error record but its interpreter waits for a thread: after
    # REPORTED_EXIT_S the call fails anyway, and the rank counts as failed.
    started = time.monotonic()
    call = Played(Rank(raises=DivergedError("late"), stuck_exiting=True), Rank(hangs=True))
    result = call.result
    assert 0.9 < time.monotonic() - started < 10
    assert isinstance(result.error, DivergedError)
    assert call.recorder.exits()[0] == (RankState.FAILED, "raised an exception")


def test_the_timeout_names_each_running_rank_its_last_lines_and_its_stack():
    result = Played(
        Rank(prints=["step 41", "step 42"], hangs=True), Rank(stuck_exiting=True), timeout=0.3
    ).result
    assert result.outcome == "timeout" and isinstance(result.error, DistributedTimeoutError)
    text = str(result.error)
    assert "timed out after 0.3 s (timeout=0.3); every rank was stopped." in text
    assert "rank 0 was still running; its last lines:\n      step 41\n      step 42" in text
    assert "rank 1 had returned but was still exiting" in text
    assert "\n  rank 1:\n" in text  # its stack, taken before the stop (outcome/stacks.timeout_section)
    assert result.error.still_running == [0, 1]


def test_a_stop_asks_with_the_calls_grace_and_signal():
    backend = ScriptedBackend([Rank(hangs=True), Rank(hangs=True)])
    backend.stop(7.0, signal.SIGTERM)  # before the call started (and after its prepare())
    result = backend.run(request(stop_grace=30.0), EventBus([]))
    assert result.outcome == "interrupted" and "was stopped before it finished" in str(result.error)
    assert backend.stops == []  # stopped before any rank started: none was started

    class StopsOnceStarted(Recorder):  # cancel(grace) from another thread, say
        def __init__(self, backend: ScriptedBackend):
            super().__init__()
            self.backend = backend

        def handle(self, event: object) -> None:
            super().handle(event)
            if isinstance(event, RankStarted) and event.rank == 1:
                self.backend.stop(7.0, signal.SIGTERM)

    call = Played(Rank(hangs=True), Rank(hangs=True), consumers=[StopsOnceStarted], stop_grace=30.0)
    assert call.result.outcome == "interrupted" and call.backend.stops == [(7.0, signal.SIGTERM)]
    assert {state for state, _ in call.recorder.exits().values()} == {RankState.KILLED}


@pytest.mark.fault(
    "rank 737 of 1,000 (125 nodes of 8) raises while every rank prints",
    "rank 737 is the root cause; the 999 others are stopped by air_magic",
)
def test_a_rank_failing_among_a_thousand_is_the_root_cause():
    world, failing = 1000, 737
    ranks = [Rank(prints=["step 1 loss 0.5"] * 10, hangs=True) for _ in range(world)]
    ranks[failing] = Rank(prints=["step 1 loss 0.5"] * 10, raises=DivergedError("nan at step 1"), at=5.0)
    call = Played(*ranks, nodes=[8] * 125)
    result = call.result
    assert isinstance(result.error, DivergedError) and call.failed_rank == failing
    exits = call.recorder.exits()
    assert exits.pop(failing) == (RankState.FAILED, "raised an exception")
    assert set(exits.values()) == {(RankState.KILLED, "stopped by air_magic")} and len(exits) == world - 1


def test_a_lost_node_is_an_own_failure_and_its_ranks_are_named_together():
    bus = Recorder()
    nodes = {"ranks_per_node": [1, 2], "node_names": ["node 0", "node 1"], "clocks": [0.0, 0.0]}
    ledger = CallLedger(request(3), EventBus([bus]), _Router(), "/logs", **nodes)
    for rank in range(3):
        ledger.started(rank, 10 + rank)
    gloo = RuntimeError("gloo: Connection closed by peer")
    ledger.take(1, NodeLost("its raylet died"))
    ledger.take(0, exited(0, 1, time.monotonic() + 5, error=record(0, time.monotonic() + 5, gloo)))
    assert ledger.all_exited() and ledger.failed(time.monotonic())
    error = ledger.failure_error()
    assert isinstance(error, RankFailedError) and error.rank == 1
    text = str(error)
    assert text.startswith("node 1 was lost during the call: its raylet died, and rank(s) 1, 2 with it")
    assert "1 other rank(s) failed after it (collective errors)" in text
    assert bus.exits()[2] == (RankState.FAILED, "its node or agent was lost")


def test_another_nodes_metric_lines_become_an_event_and_no_file(tmp_path):
    """The ledger gives events and decisions and writes no file: a remote rank's metric bytes go on
    the bus (the tracked run keeps them), even where the request names a metric folder."""
    bus = Recorder()
    folder = tmp_path / "metrics"
    folder.mkdir()
    ledger = CallLedger(
        request(env={"AIR_MAGIC_METRICS_DIR": str(folder)}),
        EventBus([bus]),
        _Router(),
        "/logs",
        ranks_per_node=[2],
    )
    ledger.take(0, Metrics(1, b"loss\t0.5\t1\t0\n"))
    assert RankMetrics(1, b"loss\t0.5\t1\t0\n") in bus.events
    assert list(folder.iterdir()) == []


def test_a_group_done_with_ranks_unreported_loses_them():
    ledger = CallLedger(request(), EventBus([]), _Router(), "/logs", ranks_per_node=[2])
    ledger.started(0, 10)
    ledger.started(1, 11)
    ledger.take(0, exited(0, 0, 1.0, result=serialization.dumps(0)))
    ledger.take(0, GroupDone())
    assert ledger.all_exited() and ledger.records[1].lost is not None and ledger.failed(time.monotonic())


def test_the_timeout_text_is_one_for_calls_and_cells():
    error = timeout_error(5, [(1, [], False)], {}, "/logs", subject="cell 3", then="session s1 goes on")
    assert str(error).startswith("cell 3 timed out after 5 s (timeout=5); session s1 goes on.\n")
    assert "rank 1 was still running; its last lines:\n      (nothing printed)" in str(error)


class _Router:
    def __init__(self) -> None:
        from air_magic.backends.output import RankTail

        self.tails = [RankTail() for _ in range(8)]

    def feed(self, rank, stream, data) -> None:
        self.tails[rank].add(data.decode())

    def log_path(self, rank: int) -> str:
        return f"/logs/rank_{rank}.log"


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSEGV])
def test_a_death_without_a_record_is_named_by_its_signal(signum):
    result = Played(Rank(hangs=True), Rank(killed_by=signum)).result
    assert isinstance(result.error, RankFailedError) and result.error.rank == 1
    assert signal.Signals(signum).name in str(result.error)


def test_a_rank_whose_status_died_with_the_warm_starter_is_said_unknown():
    ledger = CallLedger(request(), EventBus([]), _Router(), "/logs", ranks_per_node=[2])
    ledger.started(0, 10)
    ledger.started(1, 11)
    ledger.take(0, exited(1, None, 1.0, status_lost=True))
    assert ledger.failed(time.monotonic())
    error = ledger.failure_error()
    assert isinstance(error, RankFailedError) and error.rank == 1
    assert "exit status is unknown" in str(error)
