"""Frameworks unchanged (issue 33, item 3): their own test scripts, under air_magic and under torchrun.

Accelerate ships the scripts its own CI launches on several processes
(``accelerate/test_utils/scripts``). Each runs under ``air-magic run`` on warm ranks; ``test_ops``
also on fresh ones and under torchrun as the oracle (its ``main`` through the decorator:
tests/kernel/test_frameworks_notebook.py), with ``ACCELERATE_USE_CPU=1`` as ``accelerate launch
--cpu`` sets it: air_magic's CPU ranks get that variable themselves (launch/rank_env.py), so nothing
is set for them here. The trainers of Lightning and transformers run warm and under torchrun, the
Lightning Trainer also fresh: the same final weights. (A framework is imported in the rank, warm or
fresh, after the same hooks: one framework fresh is the suite's budget, 15 minutes on 2 cores.)
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers.cli import environment, invoke
from helpers.modules import skip_unless_installed
from helpers.oracle import torchrun_weights
from helpers.paths import FRAMEWORKS as FRAMEWORK_FILES

FRAMEWORKS = str(FRAMEWORK_FILES)

SCRIPTS = ("test_ops", "test_sync", "test_script")


def _script(name: str) -> str:
    import importlib.util

    spec = importlib.util.find_spec(f"accelerate.test_utils.scripts.{name}")
    assert spec is not None and spec.origin is not None
    return spec.origin


@skip_unless_installed("accelerate")
@pytest.mark.timeout(400)  # torchrun and three runs of Accelerate's checks
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
        # The decorator's path (the script's main() on every rank) is test_frameworks_notebook's.
    for how, done in ours.items():
        assert done.returncode == 0, (how, done.stderr[-3000:])
        assert "Traceback" not in done.stderr, (how, done.stderr[-3000:])  # warm exits end cleanly too
    assert not os.environ.get("ACCELERATE_USE_CPU")  # the caller set nothing for its ranks


@pytest.mark.parametrize(
    ("script", "package"),
    [
        ("lightning_ddp.py", "lightning"),
        ("lightning_fabric.py", "lightning"),
        ("transformers_trainer.py", "transformers"),
    ],
    ids=["lightning-ddp", "lightning-fabric", "transformers-trainer"],
)
def test_a_frameworks_trainer_gives_torchruns_final_weights(tmp_path, tmp_path_factory, script, package):
    pytest.importorskip(package)  # here, not at collection: importing it costs seconds
    import torch

    path = os.path.join(FRAMEWORKS, script)
    expected = torchrun_weights(tmp_path_factory, script)
    for how, options in {"warm": [], "fresh": ["--no-warm-start"]}.items():
        if how == "fresh" and script != "lightning_ddp.py":
            continue  # one framework fresh (all import in the rank either way): the suite's budget
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


@pytest.mark.fault(
    "a Lightning strategy that starts processes of its own (ddp_spawn, ddp_notebook; Trainer or Fabric) "
    "runs inside a rank",
    'every rank fails at once naming strategy="ddp"; under torchrun it hangs',
)
@skip_unless_installed("lightning")
@pytest.mark.parametrize(
    ("script", "strategy", "options"),
    [
        ("lightning_ddp.py", "ddp_spawn", []),  # the Trainer's launcher, spawning
        ("lightning_fabric.py", "ddp_notebook", ["--no-warm-start"]),  # Fabric's, forking
    ],
    ids=["trainer-ddp_spawn-warm", "fabric-ddp_notebook-fresh"],
)
def test_a_lightning_strategy_that_starts_processes_fails_fast_naming_ddp(
    tmp_path, script, strategy, options
):
    path = os.path.join(FRAMEWORKS, script)
    done = invoke(
        "run", "--no-tracking", *options, path, str(tmp_path / "out.pt"), str(tmp_path / "out"), strategy,
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    said = done.stderr[-3000:]
    assert "StrategyStartsProcesses" in said and 'use strategy="ddp"' in said, said
    assert "raised on rank" in done.stderr  # the rank's own error, not a timeout or a hang


@skip_unless_installed("deepspeed")
@pytest.mark.timeout(400)  # DeepSpeed's first use compiles its CPU op (about 25 s)
def test_deepspeeds_init_distributed_on_gloo_never_imports_mpi4py(tmp_path):
    import json

    path = os.path.join(FRAMEWORKS, "deepspeed_gloo.py")

    def facts(output: str) -> list[dict]:
        lines = [line[line.index("{") :] for line in output.splitlines() if '"mpi4py"' in line]
        return sorted((json.loads(line) for line in lines), key=lambda f: f["rank"])

    # --tee gives each rank's line a prefix of its own: unprefixed, torchrun may join the two lines.
    oracle = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--tee=3",
         "--role=r", path],
        cwd=tmp_path, env=environment(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert oracle.returncode == 0, oracle.stderr[-3000:]
    expected = facts(oracle.stdout)
    assert expected == [{"rank": r, "world": 2, "sum": 3.0, "mpi4py": False} for r in (0, 1)]
    # Warm ranks (DeepSpeed is imported in the rank either way: a fresh one adds nothing here).
    done = invoke("run", "--no-tracking", path, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert facts(done.stdout + done.stderr) == expected, (done.stdout, done.stderr[-2000:])


@pytest.mark.parametrize(
    ("script", "package", "metric", "arguments", "preload"),
    [
        ("transformers_mlflow.py", "transformers", "loss", [], None),
        ("accelerate_mlflow.py", "accelerate", "loss", [], None),
        ("lightning_mlflow.py", "lightning", "train_loss", [], "torch,lightning"),
        ("lightning_mlflow.py", "lightning", "train_loss", ["chosen-by-the-logger"], None),
    ],
    ids=[
        "transformers-MLflowCallback",
        "accelerate-tracker",
        "lightning-MLFlowLogger-preloaded",
        "lightning-own-experiment",
    ],
)
def test_a_frameworks_mlflow_logging_lands_in_the_calls_run(
    store, tmp_path, monkeypatch, script, package, metric, arguments, preload
):
    """Each used as its docs say: the call's run gets the metrics, or (a logger asking for an
    experiment of its own) a child of the call's run does; never a separate top-level run.
    "preloaded": the warm starter imported Lightning before the call, so Lightning's default
    tracking URI (read when it is imported) is not the call's store."""
    pytest.importorskip(package)
    if preload:
        monkeypatch.setenv("AIR_MAGIC_PRELOAD", preload)
    done = invoke("run", "--experiment", "frameworks", os.path.join(FRAMEWORKS, script), *arguments,
                  cwd=tmp_path, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    experiments = [e.experiment_id for e in store.search_experiments()]
    runs = store.search_runs(experiments)
    top = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert [r.info.run_name for r in top] == [script], [(r.info.run_name, r.data.tags) for r in runs]
    call = top[0]
    assert call.info.status == "FINISHED"  # the framework's own end of run did not end it early
    children = [r for r in runs if r is not call]
    assert all(r.data.tags["mlflow.parentRunId"] == call.info.run_id for r in children)
    if arguments:  # the logger's own run, in its experiment, under the call's run
        (child,) = children
        assert store.get_experiment(child.info.experiment_id).name == arguments[0]
        assert metric in child.data.metrics and child.info.status == "FINISHED", child
    else:
        assert metric in call.data.metrics, call.data.metrics
        assert not children, children


_FIRST_ACCELERATOR = """
import os, torch
from accelerate import Accelerator
first = Accelerator()
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = first.prepare(model, optimizer)
first.mixed_precision, first.num_processes
"""
_SECOND_ACCELERATOR = """
second = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
second.mixed_precision, second.gradient_accumulation_steps, second.num_processes
"""
_FIRST_STILL_WORKS = """
first.backward(model(torch.ones(2, 4)).sum())
optimizer.step()
gathered = first.gather(torch.tensor([first.process_index])).tolist()
first.mixed_precision, first.gradient_accumulation_steps, gathered
"""
_ONE_CELL_SHARES = """
a, b = Accelerator(), Accelerator()
a.state.__dict__ is b.state.__dict__ and a.state.__dict__ is not second.state.__dict__
"""
# What an Accelerator with an FSDP or DeepSpeed plugin does to the process's state (GPUs only).
_PLUGIN_OVERWRITES_THE_TYPE = """
from accelerate.state import PartialState
from accelerate.utils import DistributedType
a.state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
"""


@skip_unless_installed("accelerate")
def test_a_session_cell_may_build_a_new_accelerator():
    """Accelerate's per-process state would refuse a second Accelerator with another
    mixed_precision ("restart your runtime"); in a session each cell's first one starts afresh,
    the earlier cells' objects keep working, and Accelerators of one cell share the state."""
    import air_magic

    with air_magic.session(num_accelerators=2, display="none", tracking=False) as s:
        assert s.run_cell(_FIRST_ACCELERATOR) == [("no", 2)] * 2
        assert s.run_cell(_SECOND_ACCELERATOR) == [("bf16", 2, 2)] * 2
        assert s.run_cell(_FIRST_STILL_WORKS) == [("no", 1, [0, 1])] * 2
        assert s.run_cell(_ONE_CELL_SHARES) == [True] * 2
        s.run_cell(_PLUGIN_OVERWRITES_THE_TYPE)
        assert s.run_cell("Accelerator().distributed_type.value") == ["MULTI_CPU"] * 2
