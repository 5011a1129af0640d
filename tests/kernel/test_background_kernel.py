"""Background runs in a real Jupyter kernel: other cells run meanwhile, tabs keep streaming, shutdown.

nbclient executes a notebook whose later cells run while the first cell's ranks
are still going (they wait on a gate file a later cell creates); the tabs'
final contents come from the stored widget state. A kernel shut down with a
background run going must leave no rank and mark the run KILLED.
"""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
from helpers.modules import lazy, skip_unless_installed
from helpers.ranks import mlflow_status

pytestmark = skip_unless_installed("nbformat", "nbclient", "ipywidgets")
nbformat = lazy("nbformat")
from helpers.kernel import Kernel, notebook_client  # noqa: E402

from air_magic.calls.history import RunInfo  # noqa: E402

fault = pytest.mark.fault


CELLS = [
    "%load_ext air_magic\nimport air_magic, os, pathlib\ngate = pathlib.Path('gate')",
    # The call returns a handle at once; its tabs are shown in this cell.
    "@air_magic.distributed(num_accelerators=2, tracking=False)\n"
    "def waits(gate):\n"
    "    import os, time\n"
    "    print(f'rank {os.environ[\"RANK\"]} waiting', flush=True)\n"
    "    while not os.path.exists(gate):\n"
    "        time.sleep(0.02)\n"
    "    print(f'rank {os.environ[\"RANK\"]} went through the gate', flush=True)\n"
    "    return int(os.environ['RANK'])\n"
    "handle = waits.distributed_async(str(gate.resolve()))\n"
    "handle",
    # Another cell, while the ranks wait: it runs, and it opens the gate.
    "print('another cell ran; done:', handle.done())\ngate.touch()",
    "handle.result(timeout=120)",
    "%%distributed -n 2 --background --no-tracking\nanswer = 6 * 7\n",
    "_.result(timeout=120)\nprint('answer', answer)",
    # The tabs' contents as the kernel holds them (nbclient keeps only the widget messages of the
    # cell it is running; a frontend applies every one, whichever cell sent it).
    "import json, ipywidgets\nfrom ipywidgets.widgets.widget import _instances\n"
    "widgets = list(_instances.values())\n"
    "print(json.dumps([[''.join(o.get('text', '') for o in w.outputs) for w in widgets"
    " if isinstance(w, ipywidgets.Output)], [w.value for w in widgets if isinstance(w, ipywidgets.HTML)]]))",
]


def test_other_cells_run_while_a_background_run_streams_into_its_tabs(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    notebook_client(nb, timeout=180, path=tmp_path).execute()
    code = nb.cells
    started = "".join(json.dumps(o) for o in code[1].outputs)
    assert "application/vnd.jupyter.widget-view+json" in started  # the tabs, and the status line
    assert "another cell ran; done: False" in "".join(o.get("text", "") for o in code[2].outputs)
    assert code[3].outputs[-1]["data"]["text/plain"] == "[0, 1]"
    assert "answer 42" in "".join(o.get("text", "") for o in code[5].outputs)
    # What the ranks printed after their cell had ended went to their tabs, and to no other cell.
    texts, statuses = json.loads("".join(o.get("text", "") for o in code[6].outputs))
    for rank in (0, 1):
        assert f"rank {rank} waiting\nrank {rank} went through the gate\n" in texts, texts
    for cell in code[2:6]:
        assert "went through the gate" not in json.dumps(cell.outputs)
    assert any("in the background: <b>succeeded</b>" in s for s in statuses), statuses


def _output(kernel: Kernel, code: str) -> str:
    texts: list[str] = []

    def keep(msg: dict) -> None:
        if msg["msg_type"] == "stream":
            texts.append(msg["content"]["text"])

    reply, _ = kernel.run(code, on_message=keep)
    assert reply["status"] == "ok", reply
    return "".join(texts)


@fault(
    "kernel shutdown with a background run going",
    "every rank gone within 5 s; the run ends KILLED",
)
def test_shutting_the_kernel_down_stops_its_background_runs(tmp_path):
    with Kernel(cwd=tmp_path) as kernel:
        _output(
            kernel,
            "%load_ext air_magic\nimport air_magic, time\n"
            "@air_magic.distributed(num_accelerators=2, display='none')\n"
            "def forever():\n"
            "    import time\n"
            "    while True:\n"
            "        time.sleep(0.1)\n"
            "handle = forever.distributed_async()\n",
        )
        deadline = time.monotonic() + 120
        while True:
            found = json.loads(
                _output(
                    kernel,
                    "import json; print(json.dumps([sorted(handle.rank_pids.values()), handle.status]))",
                )
            )
            if len(found[0]) == 2 and found[1] == "running":
                break
            assert time.monotonic() < deadline, found
            time.sleep(0.2)
        pids = found[0]
        run_id = _output(kernel, "print(air_magic.last_run().mlflow_run_id)").strip()
        kernel.kc.stop_channels()
        kernel.km.shutdown_kernel(now=False)  # an orderly shutdown: the kernel runs its exit hooks
        deadline = time.monotonic() + 5
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            assert time.monotonic() < deadline, f"ranks {pids} outlived the kernel"
            time.sleep(0.05)
        assert mlflow_status(RunInfo("", "", 0, "", mlflow_run_id=run_id)) == "KILLED"
        kernel.km.shutdown_kernel = lambda now=False: None  # already down: close() has nothing to do


@fault(
    "the kernel is killed (SIGKILL) while a detached run runs",
    "a new kernel attaches: every line printed before and after, the result; run FINISHED",
)
def test_a_detached_run_survives_its_kernel_and_a_new_kernel_attaches(tmp_path):
    gate = tmp_path / "gate"
    start = (
        "%load_ext air_magic\nimport air_magic\n"
        "@air_magic.distributed(num_accelerators=2, detach=True)\n"
        "def waits(gate):\n"
        "    import os, time\n"
        "    print(f'rank {os.environ[\"RANK\"]} before the gate', flush=True)\n"
        "    while not os.path.exists(gate):\n"
        "        time.sleep(0.02)\n"
        "    print(f'rank {os.environ[\"RANK\"]} after the gate', flush=True)\n"
        "    return int(os.environ['RANK'])\n"
        f"handle = waits.distributed_async({str(gate)!r})\n"
        "print(handle.detached_id)\n"
    )
    with Kernel(cwd=tmp_path) as first:
        run_id = _output(first, start).strip().splitlines()[-1]
        deadline = time.monotonic() + 120
        while "before the gate" not in _output(first, "print(handle.logs(0), handle.logs(1))").replace(
            "rank 0 before", ""
        ):
            assert time.monotonic() < deadline, "rank 1 did not reach the gate"
            time.sleep(0.2)
        os.kill(first.pid, signal.SIGKILL)
        first.km.shutdown_kernel = lambda now=False: None  # killed: close() has nothing to do
    with Kernel(cwd=tmp_path) as second:
        out = _output(
            second,
            "import air_magic, json, pathlib, ipywidgets\n"
            "from ipywidgets.widgets.widget import _instances\n"
            f"print([r.status for r in air_magic.runs() if r.id == {run_id!r}])\n"
            f"handle = air_magic.attach({run_id!r})\n"
            f"pathlib.Path({str(gate)!r}).touch()\n"
            "print(handle.result(timeout=120), handle.status)\n"
            "outs = [w for w in list(_instances.values()) if isinstance(w, ipywidgets.Output)]\n"
            "print(json.dumps([''.join(o.get('text', '') for o in w.outputs) for w in outs]))\n"
            "state = json.loads(pathlib.Path(air_magic.runs()[0].folder, 'state.json').read_text())\n"
            "print(state['mlflow_run_id'])\n",
        )
    lines = out.strip().splitlines()
    assert lines[0] == "['running']"
    assert lines[1] == "[0, 1] succeeded"
    texts = json.loads(lines[2])
    for rank in (0, 1):  # the tabs of the new kernel: what was printed before it attached, then after
        assert f"rank {rank} before the gate\nrank {rank} after the gate\n" in texts, texts
    assert mlflow_status(RunInfo("", "", 0, "", mlflow_run_id=lines[3])) == "FINISHED"


def _bundles(outputs: list) -> list[dict]:
    return [o["data"] for o in outputs if o["output_type"] == "display_data"]


def test_a_background_cells_saved_record_tells_the_runs_end(tmp_path):
    """nbclient (nbconvert --execute, papermill) keeps only what comes while a cell runs: the run's
    end, sent from its thread after its cell ended, is written into the record by a later cell."""
    cells = [
        "%load_ext air_magic",
        "%%distributed -n 2 --background\nimport os\nfor step in range(5):\n"
        "    print(f'rank {os.environ[\"RANK\"]} step {step}')\n",
        "_.result(timeout=120)\nimport air_magic\nprint(air_magic.last_run().mlflow_run_id)",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    notebook_client(nb, timeout=180, path=tmp_path).execute()
    run_id = "".join(o.get("text", "") for o in nb.cells[2].outputs).strip().splitlines()[-1]
    tabs, status = _bundles(nb.cells[1].outputs)
    assert "application/vnd.jupyter.widget-view+json" in tabs  # the live tabs, for frontends that can
    text, page = tabs["text/plain"], tabs["text/html"]
    assert text.startswith("cell [2]: succeeded in "), text
    assert "not started yet" not in text and "starting" not in text and "still" not in text
    for rank in (0, 1):
        assert f"rank {rank} succeeded" in text and f"rank {rank} step 4" in text
        assert f"rank {rank} step 4" in page
    assert "<b>succeeded</b>" in page and "logs:" in page
    assert run_id and run_id in text  # the MLflow run
    assert "in the background: succeeded" in status["text/plain"], status
    # The saved widget state (what JupyterLab shows of a saved notebook, or an HTML export with it).
    widgets = json.dumps(nb.metadata.widgets, ensure_ascii=False)
    assert "rank 1 step 4" in widgets and "in the background: <b>succeeded</b>" in widgets
    assert "· succeeded ·" in widgets  # the tabs' top line


def test_a_background_run_still_going_when_the_notebook_ends_says_so(tmp_path):
    cells = [
        "%load_ext air_magic\nimport air_magic, time",
        "@air_magic.distributed(num_accelerators=2, tracking=False)\n"
        "def forever():\n"
        "    import os, time\n"
        "    print(f'rank {os.environ[\"RANK\"]} up', flush=True)\n"
        "    while True:\n"
        "        time.sleep(0.1)\n"
        "handle = forever.distributed_async()\n"
        "handle",
        "deadline = time.monotonic() + 120\n"
        "while (handle.status, len(handle.logs(1))) == ('starting', 0) or not handle.logs(1):\n"
        "    assert time.monotonic() < deadline, handle\n"
        "    time.sleep(0.1)\n"
        "time.sleep(0.5)  # the tabs' next refresh has the lines\n"
        "print(handle.status)",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    notebook_client(nb, timeout=180, path=tmp_path).execute()  # its end shuts the kernel down: cancelled
    assert "running" in "".join(o.get("text", "") for o in nb.cells[2].outputs)
    tabs, status = _bundles(nb.cells[1].outputs)
    text = tabs["text/plain"]
    assert text.startswith("forever: running in "), text
    assert "not started yet" not in text
    assert "still running at " in text and "still running at " in tabs["text/html"]
    assert "rank 1 up" in text
    assert "in the background: running" in status["text/plain"], status
