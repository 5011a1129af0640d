"""Frameworks unchanged in a notebook (issue 33, item 3): a real Jupyter kernel runs the training
files of ``tests/process/frameworks`` as a user would paste them, in a ``%%distributed`` cell and as
a function defined in the notebook called through the decorator, on warm ranks; the final weights
are torchrun's for the same file (``helpers/oracle.py``), bit for bit.

The kernel's warm starter preloads the frameworks (``AIR_MAGIC_PRELOAD``), as a user who runs them
cell after cell would: the patches of ``worker/frameworks.py`` and ``worker/mlflow_hook.py`` then
meet modules that were imported before the rank started. ``tests/process/test_frameworks.py``
covers the other case (the rank imports them) through ``air-magic run``.
"""

from __future__ import annotations

import os

import pytest
from helpers.modules import skip_unless_installed
from helpers.oracle import torchrun_weights
from helpers.paths import FRAMEWORKS

pytestmark = skip_unless_installed("jupyter_client", "ipykernel", "lightning", "transformers", "accelerate")
from helpers.kernel import Kernel  # noqa: E402

# Each trainer through the decorator on warm ranks, the Trainers also as a cell; no fresh ranks
# (a fresh rank here costs ~6 s of both cores; tests/process/test_frameworks.py runs fresh ones
# through `air-magic run`: what a surface changes is how the code reaches the rank, not how the
# rank starts). The suite's 15 minutes are the budget.
TRAINERS = {  # file: [(surface, warm)]
    "lightning_ddp.py": [("cell", True), ("function", True)],
    "lightning_fabric.py": [("function", True)],
    "transformers_trainer.py": [("cell", True), ("function", True)],
}


@pytest.fixture
def kernel(tmp_path):
    folder = tmp_path / "notebook"
    folder.mkdir()
    env = {**os.environ, "AIR_MAGIC_PRELOAD": "torch,lightning,transformers,accelerate"}
    with Kernel(cwd=folder, env=env) as k:
        _ok(k, "%load_ext air_magic\nfrom air_magic import distributed")
        yield k


def _ok(kernel, code, timeout=300):
    reply, _ = kernel.run(code, timeout=timeout)
    assert reply["status"] == "ok", "\n".join(reply.get("traceback", [])) or reply
    return reply


def _pasted(script):
    """The file as a user pastes it into a cell: everything but its command-line entry point."""
    source = (FRAMEWORKS / script).read_text()
    return source.split('\nif __name__ == "__main__":')[0]


@pytest.mark.timeout(600)  # three trainers, five calls, the oracles: about 50 s alone, more under load
def test_trainers_pasted_into_a_notebook_give_torchruns_final_weights(kernel, tmp_path, tmp_path_factory):
    """One kernel for the three (a kernel and its starter's preload cost seconds each)."""
    for script in TRAINERS:
        _trainer_in_a_notebook(kernel, tmp_path / script.removesuffix(".py"), tmp_path_factory, script)


def _trainer_in_a_notebook(kernel, tmp_path, tmp_path_factory, script):
    import torch

    expected = torchrun_weights(tmp_path_factory, script)
    tmp_path.mkdir()
    source = _pasted(script)
    _ok(kernel, source)  # for the decorator: main (and its classes) defined in the notebook
    for surface, warm in TRAINERS[script]:
        out = tmp_path / f"{surface}-{warm}.pt"
        arguments = f"{str(out)!r}, {str(tmp_path / f'{surface}-{warm}')!r}"
        if surface == "cell":  # the file's code runs in each rank
            options = "" if warm else " --no-warm-start"
            code = f"%%distributed -n 2 --no-tracking --display text{options}\n{source}\nmain({arguments})"
        else:  # the function and its classes go to the ranks by value
            options = "" if warm else ", warm_start=False"
            function = f"distributed(num_accelerators=2, tracking=False, display='text'{options})(main)"
            code = f"{function}.distributed({arguments})"
        _ok(kernel, code)
        got = torch.load(out)
        assert all(torch.equal(got[k], expected[k]) for k in expected), (surface, warm, got, expected)


@pytest.mark.timeout(300)
def test_accelerates_own_script_in_a_notebook(kernel):
    """Accelerate's test_ops (its own multi-process checks) as a cell and through the decorator (warm
    ranks: fresh ones run it through `air-magic run`). DeepSpeed's init_distributed runs through
    `air-magic run` only (tests/process/test_frameworks.py): what a notebook adds, a file's code
    pasted into a cell or sent by value, the trainers above prove, and the suite's 15 minutes are
    the budget."""
    _ok(kernel, "%%distributed -n 2 --no-tracking --display text\n"
                "from accelerate.test_utils.scripts import test_ops\ntest_ops.main()")  # fmt: skip
    _ok(kernel, "from accelerate.test_utils.scripts import test_ops\n"
                "distributed(num_accelerators=2, tracking=False, display='text')"
                "(test_ops.main).distributed()")  # fmt: skip
