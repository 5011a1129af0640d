"""Warm equals fresh: the same probes give equivalent answers in forked (warm) and fresh (cold) ranks.

The warm start must be invisible (issue "Faithful ranks"). Each probe runs
under both modes; answers that a fresh ``python`` gives the same way every
time must be equal, and answers a fresh ``python`` draws at random (seeds)
must differ between ranks and between calls in both modes. The one
difference a fork cannot remove, the hash secret when ``PYTHONHASHSEED`` is
unset, is documented in docs/architecture.md and checked here as such.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers.ranks import ready_starter

from air_magic import distributed
from air_magic.calls.history import last_run
from air_magic.errors import DistributedTimeoutError
from air_magic.node import warm

MODES = [pytest.param(True, id="warm"), pytest.param(False, id="fresh")]

# Set per call or per process by design: compared only by presence.
_PER_CALL = {
    "MASTER_PORT",
    "AIR_MAGIC_LIFELINE_FD",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",  # in the call's folder
    "AIR_MAGIC_RUN_ID",
    "AIR_MAGIC_RUN_DIR",
    "AIR_MAGIC_LOG_DIR",
}


def _run(fn, warm_start, *args, n=2, **settings):
    if warm_start and settings.get("timeout") is not None and "env" not in settings:
        # A test that sets a start-up variable (PYTHONHASHSEED, ...) gets a starter rebuilt for it
        # (warm.get_starter): its import must not eat a short timeout.
        ready_starter()
    settings.setdefault("display", "none")
    settings.setdefault("tracking", False)
    return distributed(num_accelerators=n, warm_start=warm_start, **settings)(fn).distributed(*args)


def _process_facts():
    import os
    import signal
    import sys

    mask = os.umask(0)
    os.umask(mask)
    return {
        "warnoptions": list(sys.warnoptions),
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "sys_path": list(sys.path),
        "argv": list(sys.argv),
        "sigint": getattr(signal.getsignal(signal.SIGINT), "__name__", str(signal.getsignal(signal.SIGINT))),
        "sigpipe": int(signal.getsignal(signal.SIGPIPE)),
        "umask": mask,
        "flags": tuple(sys.flags),
        **{
            name: (
                type(s).__name__,
                type(s.buffer).__name__,
                s.write_through,
                s.line_buffering,
                s.encoding,
                s.errors,
            )
            for name, s in (("stdout", sys.stdout), ("stderr", sys.stderr))
        },
        "stdin": os.read(0, 1),
        "main": sys.modules["__main__"].__name__,
    }


@pytest.mark.parametrize("warm_start", MODES)
def test_process_facts_equal_a_fresh_python(warm_start, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    old = os.umask(0o027)  # changed after the starter started: ranks must still take the caller's
    try:
        warm.prestart()
        got = _run(_process_facts, warm_start)
        expected = _run(_process_facts, False)  # the reference: fresh interpreters
    finally:
        os.umask(old)
    for facts, ref in zip(got, expected, strict=True):
        assert facts["env"].keys() == ref["env"].keys()
        same_env = {k: v for k, v in facts["env"].items() if k not in _PER_CALL}
        assert same_env == {k: v for k, v in ref["env"].items() if k not in _PER_CALL}
        for key in ("env",):
            facts.pop(key), ref.pop(key)
        assert facts == ref
        assert facts["umask"] == 0o027 and facts["cwd"] == str(tmp_path)
        # KeyboardInterrupt, or ignored when this process ignores SIGINT (a background job).
        ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert (facts["sigint"] == "default_int_handler") != ignored


def _random_draws():
    import random

    import numpy
    import torch

    return {
        "torch_seed": torch.initial_seed(),
        "torch": torch.rand(3).tolist(),
        "linear": torch.nn.Linear(4, 4).weight.sum().item(),
        "randperm": torch.randperm(10).tolist(),
        "random": random.random(),
        "numpy": float(numpy.random.random()),
    }


@pytest.mark.parametrize("warm_start", MODES)
def test_every_random_source_is_fresh_per_rank_and_per_call(warm_start):
    draws = _run(_random_draws, warm_start, n=3) + _run(_random_draws, warm_start, n=3)
    for key in ("torch_seed", "linear", "random", "numpy"):
        values = [d[key] for d in draws]
        assert len(set(values)) == len(values), f"{key} repeats across ranks or calls: {values}"
    assert len({tuple(d["torch"]) for d in draws}) == len(draws)


def _hash_and_warnings():
    import sys

    return {"hash": hash("air_magic"), "warnoptions": list(sys.warnoptions)}


def _fresh_python_hash(seed: str) -> int:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run(
        [sys.executable, "-c", "print(hash('air_magic'))"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout)


@pytest.mark.parametrize("warm_start", MODES)
def test_start_up_variables_in_env_act_as_in_a_fresh_python(warm_start):
    warm.prestart()  # a starter without them is already on its way
    env = {"PYTHONHASHSEED": "1234", "PYTHONWARNINGS": "ignore::UserWarning"}
    facts = _run(_hash_and_warnings, warm_start, env=env)
    assert [f["hash"] for f in facts] == [_fresh_python_hash("1234")] * 2
    assert all(f["warnoptions"] == ["ignore::UserWarning"] for f in facts)


@pytest.mark.parametrize("warm_start", MODES)
def test_start_up_variables_changed_in_the_caller_act_too(warm_start, monkeypatch):
    assert warm.get_starter(wait_s=120) is not None  # started before the change
    monkeypatch.setenv("PYTHONHASHSEED", "77")
    monkeypatch.setenv("PYTHONWARNINGS", "error::ResourceWarning")
    facts = _run(_hash_and_warnings, warm_start)
    assert [f["hash"] for f in facts] == [_fresh_python_hash("77")] * 2
    assert all(f["warnoptions"] == ["error::ResourceWarning"] for f in facts)


def test_without_pythonhashseed_the_hash_secret_is_the_one_documented_difference(monkeypatch):
    """A fork cannot take a new hash secret: warm ranks share their starter's (random) one."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    cold = [f["hash"] for f in _run(_hash_and_warnings, False)]
    warm_hashes = [f["hash"] for f in _run(_hash_and_warnings, True)]
    assert len(set(cold)) == 2  # fresh interpreters: one random secret each
    assert len(set(warm_hashes)) == 1 and warm_hashes[0] != hash("air_magic")  # not the caller's


def _leave_work_behind(folder):
    """Return at once, leaving work that a Python process finishes before it ends."""
    import atexit
    import os
    import tempfile
    import threading
    import time
    import zipfile

    def checkpoint():
        time.sleep(0.5)
        with open(os.path.join(folder, f"thread-{os.environ['RANK']}"), "w") as f:
            f.write("saved")

    threading.Thread(target=checkpoint).start()  # not a daemon: Python waits for it
    atexit.register(lambda: open(os.path.join(folder, f"atexit-{os.environ['RANK']}"), "w").close())
    left_open = open(os.path.join(folder, f"open-{os.environ['RANK']}"), "w")  # noqa: SIM115
    left_open.write("x" * 1000)  # stays in the file object's buffer until it is closed
    archive = zipfile.ZipFile(os.path.join(folder, f"zip-{os.environ['RANK']}"), "w")
    archive.writestr("inside.txt", "kept")  # the archive is valid only once closed (at exit)
    scratch = tempfile.TemporaryDirectory()  # removed at exit by its weakref.finalize
    with open(os.path.join(folder, f"scratch-{os.environ['RANK']}"), "w") as f:
        f.write(scratch.name)

    class HidesItsMro(type):
        """Like a type some frameworks make (transformers, Lightning): ``__mro__`` raises on it."""

        def __getattribute__(cls, name):
            if name == "__mro__":
                raise AttributeError("type object 'CLIENT' has no attribute '__mro__'")
            return super().__getattribute__(name)

    class CLIENT(metaclass=HidesItsMro):
        pass

    _LEFT_OPEN.extend([left_open, archive, scratch, CLIENT()])
    return os.getpid()


_LEFT_OPEN: list = []


@pytest.mark.parametrize("warm_start", MODES)
def test_ranks_end_like_python_threads_atexit_and_open_files(warm_start, tmp_path):
    _run(_leave_work_behind, warm_start, str(tmp_path))
    log_dir = last_run().log_dir
    for rank in (0, 1):
        # Every exit step ran: none was cut short by an object whose type cannot say what it is.
        assert "Traceback" not in (Path(log_dir) / f"rank-{rank}.log").read_text()
        assert (tmp_path / f"thread-{rank}").read_text() == "saved"
        assert (tmp_path / f"atexit-{rank}").exists()
        assert (tmp_path / f"open-{rank}").read_text() == "x" * 1000
        with zipfile.ZipFile(tmp_path / f"zip-{rank}") as archive:
            assert archive.read("inside.txt") == b"kept"
        assert not os.path.exists((tmp_path / f"scratch-{rank}").read_text())


def _return_but_never_end():
    import threading
    import time

    def forever():
        while True:
            time.sleep(0.1)

    threading.Thread(target=forever, name="never-ends").start()
    print("returning", flush=True)
    return 1


@pytest.mark.fault(
    "a rank returns but a non-daemon thread never ends",
    "the timeout stops it and says it returned but was still exiting",
)
@pytest.mark.parametrize("warm_start", MODES)
def test_a_rank_that_returned_but_cannot_exit_is_named_at_the_timeout(warm_start):
    with pytest.raises(DistributedTimeoutError) as info:
        _run(_return_but_never_end, warm_start, timeout=4)
    message = str(info.value)
    assert "had returned but was still exiting" in message and "non-daemon threads" in message
    assert "returning" in message  # its last lines


def test_a_call_in_a_daemon_thread_at_interpreter_exit_ends_quietly(tmp_path):
    """The interpreter exits while a daemon thread is inside a call: no traceback, no orphan."""
    script = tmp_path / "caller.py"
    script.write_text(
        "import threading, time\n"
        "from air_magic import distributed\n"
        "def sleepy():\n"
        "    import time; time.sleep(30)\n"
        "fn = distributed(num_accelerators=2, display='none', tracking=False)(sleepy)\n"
        "threading.Thread(target=fn.distributed, daemon=True).start()\n"
        "time.sleep(3)\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=str(tmp_path)
    )
    assert proc.returncode == 0, proc.stderr
    assert "ValueError" not in proc.stderr and "RankFailedError" not in proc.stderr, proc.stderr
