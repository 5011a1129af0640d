"""Frameworks unchanged (issue 33, item 3): their own test scripts, under air_magic and under torchrun.

Accelerate ships the scripts its own CI launches on several processes
(``accelerate/test_utils/scripts``). Each runs under ``air-magic run`` on warm ranks; ``test_ops``
also on fresh ones, as a function target (``module:main``, the decorator's path) and under torchrun
as the oracle, with ``ACCELERATE_USE_CPU=1`` as ``accelerate launch --cpu`` sets it: air_magic's CPU
ranks get that variable themselves (launch/rank_env.py), so nothing is set for them here. The
trainers of Lightning and transformers run warm, fresh and under torchrun: the same final weights.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers.cli import environment, invoke
from helpers.modules import skip_unless_installed

FRAMEWORKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "frameworks")

SCRIPTS = ("test_ops", "test_sync", "test_script")


def _script(name: str) -> str:
    import importlib.util

    spec = importlib.util.find_spec(f"accelerate.test_utils.scripts.{name}")
    assert spec is not None and spec.origin is not None
    return spec.origin


@skip_unless_installed("accelerate")
@pytest.mark.parametrize("name", SCRIPTS)
def test_accelerates_own_scripts_pass_as_under_torchrun(tmp_path, name):
    path = _script(name)
    ours = {"warm": invoke("run", "--no-tracking", path, cwd=tmp_path, timeout=300)}
    if name == "test_ops":
        # The oracle, once (the scripts' verdicts under torchrun do not depend on air_magic): it
        # passes only as `accelerate launch --cpu` runs it; without that variable each rank is alone.
        oracle = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", path],
            cwd=tmp_path,
            env={**environment(), "ACCELERATE_USE_CPU": "1"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert oracle.returncode == 0, oracle.stderr[-3000:]
        ours["fresh"] = invoke("run", "--no-tracking", "--no-warm-start", path, cwd=tmp_path, timeout=300)
        # The decorator's path: the script's main() called on every rank.
        target = f"accelerate.test_utils.scripts.{name}:main"
        ours["function"] = invoke("run", "--no-tracking", target, cwd=tmp_path, timeout=300)
    for how, done in ours.items():
        assert done.returncode == 0, (how, done.stderr[-3000:])
        assert "Traceback" not in done.stderr, (how, done.stderr[-3000:])  # warm exits end cleanly too
    assert not os.environ.get("ACCELERATE_USE_CPU")  # the caller set nothing for its ranks


@pytest.mark.parametrize(
    ("script", "package"),
    [("lightning_ddp.py", "lightning"), ("transformers_trainer.py", "transformers")],
    ids=["lightning-ddp", "transformers-trainer"],
)
def test_a_frameworks_trainer_gives_torchruns_final_weights(tmp_path, script, package):
    pytest.importorskip(package)  # here, not at collection: importing it costs seconds
    import torch

    path = os.path.join(FRAMEWORKS, script)
    oracle = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", path,
         str(tmp_path / "torchrun.pt"), str(tmp_path / "out-torchrun")],
        cwd=tmp_path, env=environment(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert oracle.returncode == 0, oracle.stderr[-3000:]
    expected = torch.load(tmp_path / "torchrun.pt")
    for how, options in {"warm": [], "fresh": ["--no-warm-start"]}.items():
        out = tmp_path / f"{how}.pt"
        done = invoke(
            "run", "--no-tracking", *options, path, str(out), str(tmp_path / f"out-{how}"),
            cwd=tmp_path, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, (how, done.stderr[-3000:])
        # No traceback from air_magic's own exit code either (a framework type without __mro__).
        assert "Traceback" not in done.stderr, (how, done.stderr[-3000:])
        got = torch.load(out)
        assert all(torch.equal(got[k], expected[k]) for k in expected), (how, got, expected)
