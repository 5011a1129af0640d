"""The backend contract: the same tests for every backend (air_magic/backends/base.py).

A backend is done when this suite passes for it. Each test runs a real call on
real rank processes through the call layer (``calls.call.run_call``), with
the backend handed in explicitly, and checks what a user sees: the values,
the error, the events, the log folder, and that nothing is left behind (the
``no_leftovers`` fixture of conftest.py runs after every test).

Backends today: ``local-fresh`` (a fresh interpreter per rank), ``local-warm``
(ranks forked from the warm starter), ``ray-warm`` (ranks forked by an agent on
each node of a real 3-node Ray cluster, conftest.ray_cluster) and ``ray-fresh``
(fresh interpreters started by those agents). And ``scripted``
(``backends/scripted.py``): no process, each rank plays the script of what the
rank function would do (:data:`SCRIPTS`), through the real call loop and ledger;
it runs the tests a script can express, marked ``unit`` (no process may start,
and it takes the unit tier's milliseconds), and skips those about real processes.
"""

from __future__ import annotations

import inspect
import os
import signal
import stat
import tempfile
import threading
import time

import pytest
from helpers.ranks import ready_starter
from helpers.recording import Recorder, Recording

from air_magic.backends.base import Backend
from air_magic.backends.local.backend import LocalBackend
from air_magic.backends.scripted import FIRST_PID, Rank, ScriptedBackend
from air_magic.calls.call import run_call
from air_magic.calls.history import last_run
from air_magic.errors import DistributedTimeoutError, LaunchError, RankFailedError
from air_magic.launch.settings import make_settings
from air_magic.protocol.events import RankExited, RankOutput, RankStarted, RankState, RunFinished, RunStarted

pytestmark = pytest.mark.contract


def _ray(warm_start: bool):
    from air_magic.backends.ray.backend import RayBackend

    return RayBackend(warm_start=warm_start)


BACKENDS = {
    "local-fresh": lambda: LocalBackend(warm_start=False),
    "local-warm": lambda: LocalBackend(warm_start=True),
    # A real 3-node Ray cluster on this machine (conftest.ray_cluster): ranks forked by each
    # node's agent from its warm starter, or fresh interpreters started by the agent.
    "ray-warm": lambda: _ray(True),
    "ray-fresh": lambda: _ray(False),
    # No process: each rank plays what the rank function would do (SCRIPTS, below).
    "scripted": lambda: ScriptedBackend(lambda request: SCRIPTS[request.name](request.plan.world_size)),
}


# The Ray backends' cases run on the session's Ray cluster: conftest marks them `ray`. The scripted
# row starts no process: marked unit, it runs under the unit tier's rule (conftest refuses a start).
PARAMS = [
    pytest.param(name, marks=pytest.mark.unit) if name == "scripted" else name for name in sorted(BACKENDS)
]


def real_processes_only(backend: Backend, why: str) -> None:
    if isinstance(backend, ScriptedBackend):
        pytest.skip(f"about real processes ({why}): a script has none")


@pytest.fixture(params=PARAMS)
def backend(request) -> Backend:
    made = BACKENDS[request.param]()
    assert made.name == request.param
    if request.param == "local-warm":
        ready_starter()  # the ranks are forks, not fresh processes (a dead or stale starter is rebuilt)
    if request.param.startswith("ray"):
        request.getfixturevalue("ray_cluster")
    return made


def call(backend: Backend, fn, *args, n: int = 2, recorder: Recorder | None = None, **settings):
    """One call of ``fn`` on ``n`` ranks of ``backend``; its RunResult."""
    settings.setdefault("display", "none")
    settings.setdefault("tracking", False)
    made = make_settings(num_accelerators=n, **settings)
    bound = inspect.signature(fn).bind(*args)
    if recorder is not None:
        backend = Recording(backend, recorder)
    return run_call(fn.__name__, fn, bound, made, backend=backend)


# -- rank functions (module level: they travel by reference to fresh and forked ranks alike) --


def whoami(scale):
    return int(os.environ["RANK"]) * scale, int(os.environ["WORLD_SIZE"]), os.getpid()


class TrainingDiverged(ValueError):
    """The user's own exception class: it must come back as itself, not as a wrapper."""


def rank_one_raises():
    if os.environ["RANK"] == "1":
        raise TrainingDiverged("loss nan at step 7")
    time.sleep(60)


def rank_one_is_killed():
    if os.environ["RANK"] == "1":
        print("about to be killed", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def rank_one_exits_0():
    if os.environ["RANK"] == "1":
        os._exit(0)
    time.sleep(60)


def _gloo_group():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    tensor = torch.ones(1)
    dist.all_reduce(tensor)  # every rank is in the group and has talked to the others
    return dist, tensor


def killed_inside_a_collective():
    dist, tensor = _gloo_group()
    if os.environ["RANK"] == "1":
        print("rank 1 dies now", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(tensor)  # the others wait here for rank 1: gloo raises "connection closed"
    time.sleep(60)


def raises_while_the_others_wait_in_a_collective():
    dist, tensor = _gloo_group()
    if os.environ["RANK"] == "1":
        raise TrainingDiverged("loss nan before the second all_reduce")
    dist.all_reduce(tensor)
    time.sleep(60)


def prints_then_hangs():
    print(f"rank {os.environ['RANK']} step 41", flush=True)
    print(f"rank {os.environ['RANK']} step 42", flush=True)
    time.sleep(600)


def sleeps(ready_dir):
    open(os.path.join(ready_dir, os.environ["RANK"]), "w").close()
    time.sleep(600)


def prints_in_order(lines):
    import sys

    for i in range(lines):
        print(f"out {i}")
        if i % 50 == 0:
            print(f"err {i}", file=sys.stderr)
    sys.stdout.flush()
    os.write(1, b"from the fd, not sys.stdout\n")
    return lines


def ends_a_line_then_returns():
    os.write(1, b"half a line")
    time.sleep(0.2)
    os.write(1, b", then its end\n")
    return "done"


def writes_run_dir():
    return os.environ["AIR_MAGIC_RUN_DIR"], os.environ["AIR_MAGIC_LOG_DIR"]


# -- what each rank function does, as the scripted backend plays it (by the call's name) -------

_GLOO_CLOSED = "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"


def _each(world: int, rank_1: Rank, others: Rank) -> list[Rank]:
    return [rank_1 if rank == 1 else others for rank in range(world)]


SCRIPTS = {
    # whoami(10) where the values are checked, whoami(1) elsewhere (only its outcome is)
    "whoami": lambda world: [Rank(returns=(r * 10, world, FIRST_PID + r)) for r in range(world)],
    "rank_one_raises": lambda world: _each(
        world, Rank(raises=TrainingDiverged("loss nan at step 7")), Rank(hangs=True)
    ),
    "rank_one_is_killed": lambda world: _each(
        world, Rank(prints=["about to be killed"], killed_by=signal.SIGKILL), Rank(hangs=True)
    ),
    "killed_inside_a_collective": lambda world: _each(
        world,
        Rank(prints=["rank 1 dies now"], killed_by=signal.SIGKILL, at=0.1),
        Rank(raises=RuntimeError(_GLOO_CLOSED), at=0.05),  # stamped first: a peer's, all the same
    ),
    "raises_while_the_others_wait_in_a_collective": lambda world: _each(
        world,
        Rank(raises=TrainingDiverged("loss nan before the second all_reduce"), at=0.1),
        Rank(raises=RuntimeError(_GLOO_CLOSED), at=0.2),
    ),
    "rank_one_exits_0": lambda world: _each(world, Rank(exits=0), Rank(hangs=True)),
    "prints_then_hangs": lambda world: [
        Rank(prints=[f"rank {r} step 41", f"rank {r} step 42"], hangs=True) for r in range(world)
    ],
    "sleeps": lambda world: [Rank(hangs=True)] * world,
}


# -- the contract --------------------------------------------------------------------------


def test_results_come_back_in_rank_order(backend):
    recorder = Recorder()
    result = call(backend, whoami, 10, n=3, recorder=recorder)
    values = result.unwrap()
    assert [v[:2] for v in values] == [(0, 3), (10, 3), (20, 3)]
    assert len({v[2] for v in values}) == 3  # three processes
    assert result.outcome == "succeeded"
    started = recorder.of(RankStarted)
    assert sorted(e.rank for e in started) == [0, 1, 2]
    assert {e.pid for e in started} == {v[2] for v in values}
    assert [type(e) for e in (recorder.events[0], recorder.events[-1])] == [RunStarted, RunFinished]
    assert all(e.state is RankState.SUCCEEDED for e in recorder.of(RankExited))


def test_a_raising_rank_gives_its_original_exception(backend):
    started = time.monotonic()
    with pytest.raises(TrainingDiverged) as caught:
        call(backend, rank_one_raises).unwrap()
    assert time.monotonic() - started < 30  # the sleeping rank was stopped, not waited for
    assert (str(caught.value), caught.value.air_magic_rank) == ("loss nan at step 7", 1)
    assert "in rank_one_raises" in str(caught.value.__cause__)  # the rank's own traceback
    assert last_run().rank_states == {0: "killed", 1: "failed"}


def test_a_rank_killed_by_sigkill_is_named_with_its_signal(backend):
    with pytest.raises(RankFailedError) as caught:
        call(backend, rank_one_is_killed).unwrap()
    message = str(caught.value)
    assert "rank 1" in message and "SIGKILL" in message
    assert "about to be killed" in message  # its last lines
    assert last_run().rank_states[1] == "failed"


@pytest.mark.fault(
    "a rank is SIGKILLed inside a collective",
    "the killed rank is the root cause, not its peers' collective errors (every backend)",
)
def test_a_rank_killed_inside_a_collective_is_the_root_cause(backend):
    with pytest.raises(RankFailedError) as caught:
        call(backend, killed_inside_a_collective, n=3).unwrap()
    assert caught.value.rank == 1 and "killed by SIGKILL" in str(caught.value)
    assert "rank 1 dies now" in str(caught.value)
    assert last_run().rank_states[1] == "failed"


@pytest.mark.fault(
    "a rank raises while its peers wait in a collective",
    "its own exception, not its peers' collective errors (every backend)",
)
def test_a_rank_raising_while_its_peers_wait_in_a_collective_is_the_root_cause(backend):
    with pytest.raises(TrainingDiverged) as caught:
        call(backend, raises_while_the_others_wait_in_a_collective, n=3).unwrap()
    assert caught.value.air_magic_rank == 1
    assert last_run().rank_states[1] == "failed"


def test_a_rank_that_exits_0_without_a_result_fails_the_call(backend):
    with pytest.raises(RankFailedError) as caught:
        call(backend, rank_one_exits_0).unwrap()
    assert "rank 1" in str(caught.value)
    assert last_run().outcome == "failed"


def test_timeout_stops_every_rank_and_shows_their_last_lines(backend):
    if backend.name.startswith("ray"):
        # The pool's agents (and their starters) are up first: the 4 s are the ranks' own, not a
        # busy machine's time to reach three Ray actors (the start-timeout case has its own text).
        call(backend, whoami, 1).unwrap()
    timeout = 0.5 if isinstance(backend, ScriptedBackend) else 4  # no rank to start: the unit tier's time
    with pytest.raises(DistributedTimeoutError) as caught:
        call(backend, prints_then_hangs, timeout=timeout).unwrap()
    message = str(caught.value)
    assert f"timed out after {timeout:g} s" in message
    assert "rank 0 step 42" in message and "rank 1 step 42" in message
    assert sorted(caught.value.still_running) == [0, 1]
    assert last_run().outcome == "timeout"


def _when_ready(backend: Backend, ready_dir: str, n: int, action) -> threading.Thread:
    """``action`` once ``n`` ranks of ``sleeps`` are in it (its marks in ``ready_dir``; a scripted
    backend's ranks are, as soon as they run)."""

    def ready() -> bool:
        if isinstance(backend, ScriptedBackend):
            return len(backend.running()) >= n
        return len(os.listdir(ready_dir)) >= n

    def wait_then_act() -> None:
        deadline = time.monotonic() + 60
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.02)
        action()

    thread = threading.Thread(target=wait_then_act, daemon=True)
    thread.start()
    return thread


def test_an_interrupt_stops_every_rank_and_is_raised(backend, tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    main = threading.main_thread().ident
    assert main == threading.get_ident()
    try:
        _when_ready(backend, str(ready), 2, lambda: signal.pthread_kill(main, signal.SIGINT))
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            call(backend, sleeps, str(ready))
        assert time.monotonic() - started < 30
    finally:
        signal.signal(signal.SIGINT, previous)
    assert last_run().outcome == "interrupted"
    assert set(last_run().rank_states.values()) == {"killed"}


def test_stop_from_another_thread_ends_the_call(backend, tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    _when_ready(backend, str(ready), 2, backend.stop)
    result = call(backend, sleeps, str(ready))
    assert result.outcome == "interrupted"
    with pytest.raises(LaunchError, match="was stopped"):
        result.unwrap()
    assert set(last_run().rank_states.values()) == {"killed"}
    assert call(backend, whoami, 1).outcome == "succeeded"  # the backend serves the next call


def test_output_is_captured_in_order_per_rank_and_stream(backend):
    real_processes_only(backend, "what a real rank writes to its pipes and its fd 1")
    recorder = Recorder()
    call(backend, prints_in_order, 300, recorder=recorder).unwrap()
    for rank in (0, 1):
        out = "".join(e.text for e in recorder.of(RankOutput) if e.rank == rank and e.stream == "stdout")
        err = "".join(e.text for e in recorder.of(RankOutput) if e.rank == rank and e.stream == "stderr")
        assert out.splitlines() == [f"out {i}" for i in range(300)] + ["from the fd, not sys.stdout"]
        assert err.splitlines() == [f"err {i}" for i in range(0, 300, 50)]
        with open(os.path.join(last_run().log_dir, f"rank-{rank}.log")) as f:
            logged = f.read().splitlines()
        assert [line for line in logged if line.startswith("out")] == [f"out {i}" for i in range(300)]
        assert "from the fd, not sys.stdout" in logged


class SlowOnFirstOutput(Recorder):
    """Keeps the backend busy on a rank's first output: meanwhile the rank writes the rest and exits."""

    def handle(self, event: object) -> None:
        if isinstance(event, RankOutput) and not self.of(RankOutput):
            time.sleep(1.5)
        super().handle(event)


def test_a_ranks_output_all_comes_before_its_exit(backend):
    # A display ends a rank's unfinished line at its exit: output read after the exit
    # would be shown as a line of its own.
    real_processes_only(backend, "a real rank's pipes, read while it exits")
    recorder = SlowOnFirstOutput()
    call(backend, ends_a_line_then_returns, recorder=recorder).unwrap()
    for rank in (0, 1):
        mine = [e for e in recorder.events if isinstance(e, RankOutput | RankExited) and e.rank == rank]
        assert isinstance(mine[-1], RankExited) and sum(isinstance(e, RankExited) for e in mine) == 1
        assert "".join(e.text for e in mine[:-1]) == "half a line, then its end\n"


def test_folders_are_private_and_the_call_folder_is_gone(backend):
    real_processes_only(backend, "a rank's environment and its call folder")
    (call_dir, log_dir), _ = call(backend, writes_run_dir).unwrap()
    assert not os.path.exists(call_dir)  # removed after the call: the arguments were in it
    if backend.name.startswith("local"):  # a Ray node's call folder is in that node's temp folder
        assert os.path.dirname(call_dir) == tempfile.gettempdir()
    assert stat.S_IMODE(os.stat(log_dir).st_mode) == 0o700
    for name in os.listdir(log_dir):
        assert stat.S_IMODE(os.stat(os.path.join(log_dir, name)).st_mode) == 0o600, name
