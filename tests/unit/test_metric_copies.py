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
