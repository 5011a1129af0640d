"""Every frontend (SPEC §7, §9, §16): a readable record where widgets do not render, Colab, CPU hints.

A notebook executed by nbclient and exported by nbconvert without its widget
state (as GitHub and a reopened VS Code notebook show it) must still tell the
run's story; Colab gets text; the seed's GPU-only quickstart run on a CPU
machine says why it failed, in every rank's state too.
"""

from __future__ import annotations

import json

import pytest
from helpers.modules import lazy, skip_unless_installed

import air_magic
from air_magic.outcome.failures import CPU_MODE_HINT

pytestmark = skip_unless_installed("nbformat", "nbclient", "nbconvert", "ipywidgets")
nbformat = lazy("nbformat")
from helpers.kernel import notebook_client  # noqa: E402

CELLS = [
    "%load_ext air_magic",
    "%%distributed -n 2 --no-tracking\n"
    "import os\n"
    "for step in range(30):\n"
    "    print(f'rank {os.environ[\"RANK\"]} step {step}')\n"
    "print(f'rank {os.environ[\"RANK\"]} <done> & dusted')\n",
]


def test_an_exported_notebook_shows_each_ranks_last_lines_and_the_outcome(tmp_path):
    from nbconvert import HTMLExporter

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    notebook_client(nb, timeout=180, path=tmp_path).execute()
    outputs = nb.cells[1].outputs
    bundles = [o for o in outputs if o["output_type"] == "display_data"]
    assert len(bundles) == 1
    data = bundles[0]["data"]
    assert "application/vnd.jupyter.widget-view+json" in data  # the live tabs, for frontends that can
    assert not data["text/plain"].startswith("VBox(")
    assert "succeeded" in data["text/plain"] and "rank 1 step 29" in data["text/plain"]
    nb.metadata.pop("widgets", None)  # as GitHub or a reopened VS Code notebook has it: no widget state
    body, _ = HTMLExporter().from_notebook_node(nb)
    for rank in (0, 1):
        assert f"rank {rank} step 29" in body  # the last lines of every rank
        assert f"rank {rank} &lt;done&gt; &amp; dusted" in body  # escaped
        assert f"rank {rank} step 0<" not in body  # capped: the last lines only
    assert "succeeded" in body and "logs:" in body


def test_colab_gets_text(tmp_path):
    cells = [
        "import sys, types\nsys.modules['google.colab'] = types.ModuleType('google.colab')",
        *CELLS,
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    notebook_client(nb, timeout=180, path=tmp_path).execute()
    outputs = nb.cells[2].outputs
    text = "".join(o.get("text", "") for o in outputs if o["output_type"] == "stream")
    assert "[rank 0] rank 0 step 29" in text and "[rank 1] rank 1 step 29" in text
    assert "widget-view" not in json.dumps(outputs)


def _seed_quickstart() -> None:
    """The seed's first lines, as a user pastes them: a GPU is assumed."""
    import os

    import torch

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)


def test_the_seeds_gpu_quickstart_on_a_cpu_machine_says_why():
    fn = air_magic.distributed(num_accelerators=2, display="none", tracking=False)(_seed_quickstart)
    with pytest.raises(Exception) as caught:  # torch's own error type, whatever this torch raises
        fn.distributed()
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert CPU_MODE_HINT in notes
    assert CPU_MODE_HINT in "\n".join(caught.value._render_traceback_())  # what IPython shows
    info = air_magic.last_run()
    for rank, state in info.rank_states.items():  # a rank that raised its own error: failed, not killed
        with open(info.log_path(rank)) as f:
            raised = "Traceback" in f.read()
        assert state == "failed" or not raised, (rank, state)
    assert list(info.rank_states.values()).count("failed") >= 1


def test_a_failure_that_is_not_about_cuda_gets_no_cpu_hint():
    def fails():
        raise ValueError("bad batch")

    fn = air_magic.distributed(num_accelerators=2, display="none", tracking=False)(fails)
    with pytest.raises(ValueError) as caught:
        fn.distributed()
    assert CPU_MODE_HINT not in "\n".join(getattr(caught.value, "__notes__", []))
