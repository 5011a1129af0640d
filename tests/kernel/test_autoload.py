"""Opting in once: the startup file from jupyter-config/ loads the extension in every kernel."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("IPython")

from air_magic import autoload

CHECK = "print('loaded' if 'distributed' in get_ipython().magics_manager.magics['cell'] else 'absent')"


def ipython_says(env) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "IPython", "--no-banner", "-c", CHECK],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture
def ipython_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    return tmp_path / "ipython"


def test_enable_then_disable_in_a_real_ipython(ipython_dir):
    env = dict(os.environ)
    assert ipython_says(env) == "absent"
    assert autoload.main(["enable"]) == 0
    path = ipython_dir / "profile_default" / "startup" / "50-air_magic.py"
    assert path.read_text() == autoload.shipped_startup()
    assert ipython_says(env) == "loaded"
    assert autoload.status().startswith("enabled")
    assert autoload.main(["disable"]) == 0
    assert not path.exists()
    assert ipython_says(env) == "absent"


def test_a_users_own_file_is_never_overwritten_or_removed(ipython_dir):
    path = ipython_dir / "profile_default" / "startup" / "50-air_magic.py"
    path.parent.mkdir(parents=True)
    path.write_text("print('mine')\n")
    assert autoload.main(["enable"]) == 1
    assert autoload.main(["disable"]) == 1
    assert path.read_text() == "print('mine')\n"


def test_enabled_in_a_jupyter_kernel(ipython_dir):
    from helpers.kernel import Kernel

    autoload.enable()
    with Kernel(cwd=None, env=dict(os.environ)) as kernel:
        printed = kernel.printed(CHECK, timeout=60)  # the cell's reply must be ok
    assert "loaded" in printed
