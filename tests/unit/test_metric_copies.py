"""A rank on another node: its metric lines come as events and reach the store like a local rank's."""

from __future__ import annotations

import os

import pytest

from air_magic.tracking.metric_writer import MetricWriter


class Keeping:
    batch = 100

    def __init__(self) -> None:
        self.written: list[tuple] = []

    def write(self, rows) -> None:
        self.written.extend(rows)


def test_another_nodes_lines_are_kept_in_a_copy_and_stored_whole(tmp_path):
    sink = Keeping()
    writer = MetricWriter(None, "run-1", str(tmp_path), sink=sink)
    writer.append(3, b"loss\t0.5\t1700000000000\t0\nloss\t0.4\t17000000")  # a line cut mid-way
    writer.append(3, b"00001\t1\n")
    writer.append(0, b"acc\t0.9\t1700000000002\t1\n")
    assert writer.close() == 0
    assert sorted(sink.written) == [
        ("acc", 0.9, 1700000000002, 1),
        ("loss", 0.4, 1700000000001, 1),
        ("loss", 0.5, 1700000000000, 0),
    ]
    assert sorted(os.listdir(tmp_path)) == ["rank-0.tsv", "rank-3.tsv", "run-id"]


def test_a_copy_that_cannot_be_written_costs_its_rows_not_the_call(tmp_path):
    sink = Keeping()
    writer = MetricWriter(None, "run-1", str(tmp_path / "gone"), sink=sink)  # no such folder
    with pytest.warns(RuntimeWarning, match="metric rows of rank 1 could not be kept here"):
        writer.append(1, b"loss\t0.5\t1700000000000\t0\n")  # said as a warning, never raised
    assert writer.close() == 0 and sink.written == []


def _full_disk_after(monkeypatch, allowed: int) -> list[int]:
    """``os.write`` in the writer takes ``allowed`` bytes more, then fails as a full disk does."""
    import errno

    from air_magic.tracking import metric_writer

    left = [allowed]
    real = os.write

    def write(fd, data):
        if left[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        taken = real(fd, bytes(data[: left[0]]))
        left[0] -= taken
        return taken

    monkeypatch.setattr(metric_writer.os, "write", write)
    return left


def test_a_line_torn_by_a_full_disk_never_joins_the_next_lines(tmp_path, monkeypatch):
    """Bytes of a line lost mid-way: that line is dropped, not glued to the next (a wrong row)."""
    sink = Keeping()
    writer = MetricWriter(None, "run-1", str(tmp_path), sink=sink)
    left = _full_disk_after(monkeypatch, 40)
    with pytest.warns(RuntimeWarning, match="metric rows of rank 2 could not be kept here"):
        # 26 bytes, then 14 of the second line ("loss\t0.4\t1700"): the disk is full there
        writer.append(2, b"loss\t0.5\t1700000000000\t0\nloss\t0.4\t1700000000001\t1")
    left[0] = 10**6  # room again
    writer.append(2, b"2\nloss\t0.3\t1700000000003\t4\n")  # the lost line's rest, then a whole one
    writer.append(2, b"loss\t0.2\t1700000000004\t5\n")
    assert writer.close() == 0
    assert sink.written == [
        ("loss", 0.5, 1700000000000, 0),
        ("loss", 0.3, 1700000000003, 4),
        ("loss", 0.2, 1700000000004, 5),
    ]


def test_a_full_disk_said_does_not_hide_a_store_that_refuses_later(tmp_path, monkeypatch):
    class Refusing(Keeping):
        def write(self, rows) -> None:
            raise RuntimeError("the store is down")

    writer = MetricWriter(None, "run-1", str(tmp_path), sink=Refusing())
    left = _full_disk_after(monkeypatch, 0)
    with pytest.warns(RuntimeWarning, match="could not be kept here"):
        writer.append(1, b"loss\t0.5\t1700000000000\t0\n")
    left[0] = 10**6
    writer.append(1, b"loss\t0.4\t1700000000001\t1\n")
    with pytest.warns(RuntimeWarning, match="refused metric rows"):
        assert writer.write_pass() is False
    assert writer.close() == 1  # the row that reached the copy waits for the store


def test_the_tracked_run_hands_another_nodes_rank_metrics_to_its_writer(tmp_path):
    """The glue (tracking/run.TrackedRun.handle): a RankMetrics event's bytes reach the store."""
    from air_magic.protocol.events import RankMetrics
    from air_magic.tracking.run import TrackedRun

    sink = Keeping()
    writer = MetricWriter(None, "run-1", str(tmp_path), sink=sink)
    tracked = TrackedRun(None, "run-1", "0", "sqlite:///unused.db", None, {}, metrics=writer)
    tracked.handle(RankMetrics(rank=5, data=b"loss\t0.5\t1700000000000\t0\nloss\t0.4"))
    tracked.handle(RankMetrics(rank=5, data=b"\t1700000000001\t1\n"))
    assert writer.close() == 0
    assert sink.written == [("loss", 0.5, 1700000000000, 0), ("loss", 0.4, 1700000000001, 1)]
    tracked.metrics = None
    tracked.handle(RankMetrics(rank=5, data=b"acc\t1\t1\t1\n"))  # an untracked-metrics run: ignored
