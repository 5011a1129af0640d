"""The event log of a detached run, in parts: a follower replays a bounded part, never a duplicate."""

from __future__ import annotations

import os
import threading

from air_magic.protocol import event_log
from air_magic.protocol.events import (
    Outcome,
    RankExited,
    RankOutput,
    RankStarted,
    RankState,
    RecordLink,
    RunFinished,
    RunStarted,
)

LINK = RecordLink("abc123", "MLflow run abc123 in experiment train", "http://127.0.0.1:5000/#/runs/abc123")


def _write(folder, part_bytes: int, full=None) -> list:
    """Write the test's events; ``full(i)``: the disk is full while event ``i`` is handled."""
    events = [
        LINK,
        RunStarted("r1", 2, "local", "cpu", True, str(folder), "train"),
        RankStarted(0, 100),
        RankStarted(1, 101),
        *(RankOutput(i % 2, "stdout", f"line {i}\n") for i in range(200)),
        RankExited(1, RankState.SUCCEEDED, 0, ""),
        *(RankOutput(0, "stdout", f"more {i}\n") for i in range(50)),
        RankExited(0, RankState.SUCCEEDED, 0, ""),
        RunFinished("r1", Outcome.SUCCEEDED, 1.0, str(folder)),
    ]
    writer = event_log.EventLogWriter(str(folder), part_bytes=part_bytes)
    for i, event in enumerate(events):
        filling = bool(full and full(i))
        _Disk.full = (_Disk.full or "filling") if filling else False
        writer.handle(event)
    _Disk.full = False
    assert writer.finish(wait_s=5.0)
    return events


class _Disk:
    """``os`` for the event log, whose ``write`` finds the disk full while ``full`` is set: the
    first write then puts part of its bytes (as a disk that fills mid-write), the next ones none."""

    full = False
    real = os

    def __getattr__(self, name):
        return getattr(os, name)

    def write(self, fd, data):
        if not _Disk.full:
            return os.write(fd, data)
        if _Disk.full == "filling" and len(data) > 1:
            _Disk.full = "full"
            return os.write(fd, bytes(data[: len(data) // 2]))
        raise OSError(28, "No space left on device")


def _follow(folder, first_part: int) -> list:
    stop = threading.Event()

    def lines_of(part: int) -> event_log.Lines:
        return event_log.file_lines(os.path.join(folder, event_log.part_name(part)), stop, poll_s=0.01)

    return [e for e in event_log.follow(lines_of, first_part, stop) if e is not None]


def test_a_follower_from_the_first_part_sees_every_event_once(tmp_path):
    events = _write(tmp_path, part_bytes=2000)
    names = os.listdir(tmp_path)
    assert len(names) > 3 and event_log.replay_from(names) == len(names) - 2
    assert _follow(tmp_path, 0) == events


def test_a_new_follower_gets_every_rank_state_and_the_latest_output(tmp_path):
    events = _write(tmp_path, part_bytes=2000)
    got = _follow(tmp_path, event_log.replay_from(os.listdir(tmp_path)))
    assert got[:4] == events[:4]  # the MLflow run, the run and both ranks, from the part's snapshot
    assert got[0] == LINK  # a follower that attaches late still shows the link
    assert RankExited(1, RankState.SUCCEEDED, 0, "") in got
    outputs = [e for e in got if isinstance(e, RankOutput)]
    assert 0 < len(outputs) < 250 and outputs[-1] == RankOutput(0, "stdout", "more 49\n")
    assert got[-1] == events[-1]
    assert all(os.path.getsize(tmp_path / n) < 2000 + 400 for n in os.listdir(tmp_path))  # bounded


def test_one_part_when_the_log_is_small(tmp_path):
    events = _write(tmp_path, part_bytes=event_log.PART_BYTES)
    assert os.listdir(tmp_path) == ["events.jsonl"] and _follow(tmp_path, 0) == events


def test_the_calls_id_keeps_its_key_on_disk(tmp_path):
    """The log names the call's id ``run_id``, as every version wrote it and reads it (a follower of
    another version still sees the run start and end); in Python it is call_id."""
    started = RunStarted("r1", 2, "local", "cpu", True, str(tmp_path), "train")
    finished = RunFinished("r1", Outcome.SUCCEEDED, 1.0, str(tmp_path))
    for event in (started, finished):
        line = event_log.to_line(event)
        assert '"run_id": "r1"' in line and "call_id" not in line
        assert event_log.from_line(line) == event
    assert event_log.from_line(event_log.to_line(LINK)) == LINK  # the MLflow run's run_id stays


def test_a_full_disk_keeps_the_events_and_writes_them_whole_and_in_order_once_there_is_room(
    tmp_path, monkeypatch
):
    """Issue 49 (older defect): a full disk under the detached runs' folder killed the supervisor at
    its first event that did not fit. Now they wait, across a part's end, and go out whole."""
    monkeypatch.setattr(event_log, "os", _Disk())
    events = _write(tmp_path, part_bytes=2000, full=lambda i: 10 <= i < 150)
    monkeypatch.undo()
    assert _follow(tmp_path, 0) == events  # every event once, in order: no torn or glued line
    for name in os.listdir(tmp_path):
        with open(tmp_path / name) as f:
            assert all(event_log.from_line(line) is not None or "NextPart" in line for line in f)
