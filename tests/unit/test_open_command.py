"""The command a script's text names to open its MLflow run works as typed in the shell that ran it.

A fresh shell beside a virtual environment that was never activated has no ``air-magic`` on
``PATH``: the text names the script's full path there, and the bare name only where ``PATH``
finds this interpreter's own (issue 48, item 19).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from air_magic import paths
from air_magic.tracking import ui


def _script(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "air-magic"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    return script


@pytest.fixture
def venv(tmp_path, monkeypatch) -> Path:
    """A virtual environment's bin folder whose python runs this test, with its air-magic script."""
    bin_dir = tmp_path / "my project" / ".venv" / "bin"
    _script(bin_dir)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    return bin_dir


def _embedded_command(run_id: str = "abc") -> str:
    return ui.open_command(paths.embedded_mlflow_uri(), run_id)


def test_the_bare_name_where_path_finds_this_interpreters_air_magic(venv, monkeypatch):
    monkeypatch.setenv("PATH", f"{venv}{os.pathsep}/usr/bin")
    assert _embedded_command() == "air-magic ui --run abc"


def test_the_full_path_where_the_virtual_environment_is_not_activated(venv, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert _embedded_command() == f"'{venv}/air-magic' ui --run abc"  # quoted: the folder has a space


def test_the_full_path_where_another_installs_air_magic_comes_first_on_path(venv, tmp_path, monkeypatch):
    other = tmp_path / "other" / "bin"
    _script(other)
    monkeypatch.setenv("PATH", f"{other}{os.pathsep}{venv}")
    assert _embedded_command() == f"'{venv}/air-magic' ui --run abc"


def test_python_dash_m_where_this_interpreter_has_no_script(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python3"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert _embedded_command() == f"{tmp_path}/bin/python3 -m air_magic ui --run abc"


def test_another_store_is_named_after_the_command(venv, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    shown = ui.open_command("sqlite:////data/mlflow.db", "abc")
    assert shown == f"'{venv}/air-magic' ui --store 'sqlite:////data/mlflow.db' --run abc"
