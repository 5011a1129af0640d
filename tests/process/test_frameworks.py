"""Frameworks unchanged (issue 33, item 3): their own test scripts, under air_magic and under torchrun.

Accelerate ships the scripts its own CI launches on several processes
(``accelerate/test_utils/scripts``). Each runs under ``air-magic run`` (warm and fresh ranks) and
as a function target (``module:main``, the decorator's path), and under torchrun as the oracle,
with ``ACCELERATE_USE_CPU=1`` as ``accelerate launch --cpu`` sets it: air_magic's CPU ranks get
that variable themselves (launch/rank_env.py), so nothing is set for them here.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers.cli import environment, invoke
from helpers.modules import skip_unless_installed

pytestmark = skip_unless_installed("accelerate")

SCRIPTS = ("test_ops", "test_sync", "test_script")


def _script(name: str) -> str:
    import importlib.util

    spec = importlib.util.find_spec(f"accelerate.test_utils.scripts.{name}")
    assert spec is not None and spec.origin is not None
    return spec.origin


@pytest.mark.parametrize("name", SCRIPTS)
def test_accelerates_own_scripts_pass_as_under_torchrun(tmp_path, name):
    path = _script(name)
    oracle = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", path],
        cwd=tmp_path,
        env={**environment(), "ACCELERATE_USE_CPU": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert oracle.returncode == 0, oracle.stderr[-3000:]
    ours = {
        "warm": invoke("run", "--no-tracking", path, cwd=tmp_path, timeout=300),
        "fresh": invoke("run", "--no-tracking", "--no-warm-start", path, cwd=tmp_path, timeout=300),
    }
    if name == "test_ops":  # the decorator's path: the script's main() called on every rank
        ours["function"] = invoke(
            "run", "--no-tracking", f"accelerate.test_utils.scripts.{name}:main", cwd=tmp_path, timeout=300
        )
    for how, done in ours.items():
        assert done.returncode == 0, (how, done.stderr[-3000:])
        assert "Traceback" not in done.stderr, (how, done.stderr[-3000:])  # warm exits end cleanly too
    assert not os.environ.get("ACCELERATE_USE_CPU")  # the caller set nothing for its ranks
