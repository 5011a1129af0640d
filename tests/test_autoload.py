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
    from jupyter_client.manager import start_new_kernel

    autoload.enable()
    outputs: list[dict] = []
    km, kc = start_new_kernel(kernel_name="python3", env=dict(os.environ))
    try:
        reply = kc.execute_interactive(CHECK, timeout=60, output_hook=outputs.append)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert reply["content"]["status"] == "ok"
    texts = [m["content"].get("text", "") for m in outputs if m["msg_type"] == "stream"]
    assert "loaded" in "".join(texts)
