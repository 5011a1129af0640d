"""The examples (issue #7): notebooks match their scripts; the CPU-capable ones train on 2 gloo ranks.

The seed's and DeepSpeed's examples need GPUs; they run, as notebooks, in
tests/gpu on the device, along with everything here at full size.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.paths import EXAMPLES


def test_every_notebook_is_built_from_its_script():
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "build_notebooks.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_seed_example_is_the_seeds_code_with_only_the_import_changed():
    source = (EXAMPLES / "seed_mlp.py").read_text()
    assert "from air_magic import distributed\n" in source
    for line in (
        'dist.init_process_group("nccl")',
        "model = DDP(model, device_ids=[device])",
        'mlflow.log_metric("loss", loss.item(), step=step)',
        "run_train.distributed(num_epochs=3, batch_size=1)",
    ):
        assert line in source


@pytest.fixture
def examples_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


def test_ddp_example_learns_on_two_cpu_ranks(examples_path):
    import ddp_progress

    results = ddp_progress.train_cnn.with_overrides(display="none").distributed(epochs=2, samples=2000)
    assert len(results) == 2
    for result in results:
        losses = result["epoch_losses"]
        assert losses[-1] < losses[0]
    assert results[0]["accuracy"] == results[1]["accuracy"]  # all-reduced: one number for all ranks


def test_fsdp2_example_learns_on_two_cpu_ranks(examples_path):
    import fsdp2_transformer

    results = fsdp2_transformer.train_lm.with_overrides(display="none").distributed(
        steps=20, batch_size=8, seq_len=32, layers=2, width=64
    )
    losses = results[0]["losses"]
    assert results[0]["losses"] == results[1]["losses"]  # all-reduced means, the same on both ranks
    assert losses[-1] < losses[0] - 0.5


def test_data_resume_example_resumes_a_killed_call_with_the_same_batches_and_weights(examples_path, tmp_path):
    pytest.importorskip("torchdata")
    import data_resume

    fn = data_resume.train.with_overrides(display="none", tracking=False)
    assert data_resume.crash_and_resume(str(tmp_path), fn) == 5  # the checkpoint of step 4, then on
