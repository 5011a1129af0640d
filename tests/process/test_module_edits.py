"""A function decorated in a module whose file is edited without a reload: ranks see one version.

Without care, cloudpickle sends the function's body by value (the module's
attribute is the wrapper, not the function) and its helpers by reference
(ranks import the edited file): old body, new helpers. The ranks must run
what the kernel has loaded until the module is reloaded.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

VERSION = """
from air_magic import distributed

def helper():
    return "{tag} helper"

@distributed(2, display="none", tracking=False, warm_start=False)
def probe():
    return ("{tag} body", helper())
"""


@pytest.fixture
def edited_module(tmp_path, monkeypatch):
    """An importable module ``air_magic_probe_mod`` in a folder of its own on sys.path."""
    path = tmp_path / "air_magic_probe_mod.py"
    path.write_text(VERSION.format(tag="old"))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield path
    sys.modules.pop("air_magic_probe_mod", None)


def edit(path):
    """Rewrite the module and move its mtime on, so no stale bytecode can stand for it."""
    before = path.stat().st_mtime_ns
    path.write_text(VERSION.format(tag="new"))
    os.utime(path, ns=(before + 2_000_000_000, before + 2_000_000_000))


def test_ranks_run_the_loaded_version_until_reload(edited_module, capfd):
    mod = importlib.import_module("air_magic_probe_mod")
    assert mod.probe.distributed() == [("old body", "old helper")] * 2
    edit(edited_module)

    assert mod.probe.distributed() == [("old body", "old helper")] * 2
    said = capfd.readouterr().err
    assert said.count("air_magic_probe_mod.py changed on disk since it was imported") == 1
    assert "importlib.reload(air_magic_probe_mod)" in said
    # A new wrapper of the same function keeps the file state of the import; said once per edit.
    assert mod.probe.with_overrides(num_accelerators=2).distributed() == [("old body", "old helper")] * 2
    assert "changed on disk" not in capfd.readouterr().err

    importlib.reload(mod)
    assert mod.probe.distributed() == [("new body", "new helper")] * 2
    assert "changed on disk" not in capfd.readouterr().err
