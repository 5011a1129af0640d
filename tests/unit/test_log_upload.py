"""The log copy into a run's local artifact folder (tracking/log_upload.py): exact byte ranges."""

from __future__ import annotations

import os
import stat

import pytest

from air_magic.errors import ConfigurationError
from air_magic.tracking import log_upload


@pytest.mark.parametrize("kernel_copy", [True, False], ids=["copy_file_range", "by-hand"])
def test_passes_append_exactly_the_new_bytes_and_a_rewrite_replaces(tmp_path, monkeypatch, kernel_copy):
    if not kernel_copy:
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    source, target = tmp_path / "rank-0.log", tmp_path / "copy.log"
    data = os.urandom(3 * log_upload._CHUNK + 17)
    source.write_bytes(data[:1000])
    log_upload._append(str(source), str(target), 0, 1000, private=True)
    assert target.read_bytes() == data[:1000] and stat.S_IMODE(target.stat().st_mode) == 0o600
    source.write_bytes(data)  # the rank wrote more; the copy takes exactly the range asked for
    log_upload._append(str(source), str(target), 1000, len(data) - 5, private=True)
    assert target.read_bytes() == data[:-5]
    log_upload._append(str(source), str(target), len(data) - 5, len(data) + 100, private=True)
    assert target.read_bytes() == data  # a size read before the file shrank: what is there
    source.write_bytes(b"rewritten\n")
    log_upload._append(str(source), str(target), 0, 10, private=False)
    assert target.read_bytes() == b"rewritten\n"


def test_a_planted_link_is_never_written_through(tmp_path):
    source, target, victim = tmp_path / "rank-0.log", tmp_path / "copy.log", tmp_path / "victim"
    source.write_bytes(b"line\n")
    victim.write_bytes(b"kept\n")
    target.symlink_to(victim)
    with pytest.raises(ConfigurationError, match="symbolic link"):
        log_upload._append(str(source), str(target), 0, 5, private=True)  # the embedded store
    with pytest.raises(OSError):
        log_upload._append(str(source), str(target), 0, 5, private=False)  # O_NOFOLLOW
    assert victim.read_bytes() == b"kept\n"
