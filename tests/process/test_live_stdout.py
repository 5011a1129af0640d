"""A rank's stdout (worker/live_stdout.py): written through, buffered only while it floods, never lost.

Real ranks, warm and fresh alike (the same probes in both modes). What a user
debugging with prints relies on: a line printed just before the process dies
without Python's exit is there; a flood is written in chunks but reaches the
caller while the rank still runs; a fork of a flooding rank repeats nothing;
a stream the user reconfigured is theirs.
"""

from __future__ import annotations

import io
import os
import threading
import time

import pytest

from air_magic import distributed, last_run
from air_magic.errors import RankFailedError
from air_magic.worker.live_stdout import StdoutWriter

MODES = [pytest.param(True, id="warm"), pytest.param(False, id="fresh")]
FLOOD = 20_000  # lines printed in a tight loop: well past the flood rate


def _run(fn, warm_start, *args, **settings):
    settings.setdefault("display", "none")
    settings.setdefault("tracking", False)
    return distributed(num_accelerators=2, warm_start=warm_start, **settings)(fn).distributed(*args)


def _log_lines(rank):
    with open(last_run().log_path(rank)) as f:
        return f.read().splitlines()


def _flood_then_die(flood, pause):
    import os
    import sys
    import time

    for i in range(flood):
        print(f"line {i}")
    flooding = not sys.stdout.write_through
    time.sleep(pause)  # a flood that stopped: written through again after a few ticks
    print(f"last words, flooding={flooding}, after={sys.stdout.write_through}")
    if os.environ["RANK"] == "0":
        os._exit(3)  # no flush, no atexit: what is not in the pipe yet is lost
    time.sleep(30)  # rank 1 waits to be stopped: rank 0's log is the one read


@pytest.mark.fault(
    "a rank prints, then os._exit at once", "the line is in its log and tab: nothing waits in a buffer"
)
@pytest.mark.parametrize("warm_start", MODES)
def test_a_line_printed_just_before_os_exit_is_kept(warm_start):
    with pytest.raises(RankFailedError):
        _run(_flood_then_die, warm_start, 0, 0.0)
    assert _log_lines(0) == ["last words, flooding=False, after=True"]


@pytest.mark.fault(
    "a rank floods stdout, stops, prints, then os._exit at once",
    "every line is in its log: the flood was flushed, and later prints are written through again",
)
@pytest.mark.parametrize("warm_start", MODES)
def test_after_a_flood_stops_prints_are_written_through_again(warm_start):
    with pytest.raises(RankFailedError):
        _run(_flood_then_die, warm_start, FLOOD, 0.5)
    assert _log_lines(0) == [f"line {i}" for i in range(FLOOD)] + ["last words, flooding=True, after=True"]


def _flood_then_wait_for_own_log(flood):
    import os
    import time

    for i in range(flood):
        print(f"line {i}")
    print("marker")  # no flush: the flusher sends it
    path = os.path.join(os.environ["AIR_MAGIC_LOG_DIR"], f"rank-{os.environ['RANK']}.log")
    start = time.monotonic()
    while time.monotonic() - start < 30:
        with open(path) as f:
            if "marker\n" in f.read():
                return True  # the caller has logged it while this rank still runs
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("warm_start", MODES)
def test_a_flood_reaches_the_caller_while_the_rank_runs(warm_start):
    assert _run(_flood_then_wait_for_own_log, warm_start, FLOOD) == [True, True]
    for rank in (0, 1):
        log = _log_lines(rank)
        assert log == [f"line {i}" for i in range(FLOOD)] + ["marker"]


def _flood_then_fork():
    import os
    import sys

    for i in range(FLOOD):
        print(f"line {i}")
    buffered = not sys.stdout.write_through
    pid = os.fork()
    if pid == 0:
        print(f"child writes through: {sys.stdout.write_through}")
        os._exit(0)  # the child's line is already in the pipe
    os.waitpid(pid, 0)
    return buffered


@pytest.mark.parametrize("warm_start", MODES)
def test_a_fork_of_a_flooding_rank_repeats_nothing(warm_start):
    assert _run(_flood_then_fork, warm_start) == [True, True]
    for rank in (0, 1):
        log = _log_lines(rank)
        assert [line for line in log if line.startswith("line ")] == [f"line {i}" for i in range(FLOOD)]
        assert log.count("child writes through: True") == 1


def _reconfigured_by_the_user():
    import sys
    import time

    sys.stdout.reconfigure(line_buffering=True)
    for i in range(FLOOD):
        print(f"line {i}")
    time.sleep(0.1)
    return sys.stdout.line_buffering, sys.stdout.write_through


@pytest.mark.parametrize("warm_start", MODES)
def test_a_stream_the_user_reconfigured_is_left_to_them(warm_start):
    assert _run(_reconfigured_by_the_user, warm_start) == [(True, True), (True, True)]


def _flood_then_raise():
    import os
    import time

    for i in range(FLOOD):
        print(f"line {i}")
    if os.environ["RANK"] == "0":
        raise ValueError("after the flood")
    time.sleep(30)  # rank 1 waits to be stopped: rank 0's log is the one read


@pytest.mark.parametrize("warm_start", MODES)
def test_a_flood_then_an_error_loses_no_line(warm_start):
    with pytest.raises(ValueError, match="after the flood"):
        _run(_flood_then_raise, warm_start)
    log = _log_lines(0)
    assert [line for line in log if line.startswith("line ")] == [f"line {i}" for i in range(FLOOD)]
    assert "ValueError: after the flood" in log


def test_a_flush_from_another_thread_never_splices_lines_under_back_pressure():
    """The flusher thread and the rank's prints share one writer: whole chunks, every byte, in order.

    A pipe whose reader is slow makes both writers block mid-write (Linux splices writes over
    4 KiB from two writers); a FileIO without the writer's lock garbled lines here.
    """
    r, w = os.pipe()
    stream = io.TextIOWrapper(StdoutWriter(w), encoding="utf-8", write_through=False)
    stream._CHUNK_SIZE = 1 << 16
    received = bytearray()

    def read_slowly():
        while True:
            time.sleep(0.002)
            chunk = os.read(r, 4096)
            if not chunk:
                return
            received.extend(chunk)

    def flush_every_tick(stop):
        while not stop.wait(0.02):
            stream.flush()

    reader = threading.Thread(target=read_slowly)
    stop = threading.Event()
    flusher = threading.Thread(target=flush_every_tick, args=(stop,))
    reader.start()
    flusher.start()
    n = 150_000
    for i in range(n):
        stream.write(f"{i:08d}\n")
        if i % 500 == 0:
            time.sleep(0.0005)  # the rank's own pauses: the flusher writes while a chunk is pending
    stop.set()
    flusher.join()
    stream.flush()
    os.close(w)
    reader.join()
    os.close(r)
    assert received.decode().splitlines() == [f"{i:08d}" for i in range(n)]
