"""A real Jupyter kernel: the example notebook through nbclient, interrupts, and a flood of output.

nbclient executes ``examples/quickstart.ipynb`` with widget state stored, so
the tabs' final contents can be read back from the notebook's metadata.
"""

from __future__ import annotations

import os
import re
import time

import psutil
import pytest
from helpers.modules import lazy, skip_unless_installed

pytestmark = skip_unless_installed("nbformat", "nbclient", "ipywidgets")
nbformat = lazy("nbformat")
from helpers.kernel import EXAMPLES, Kernel, notebook_client  # noqa: E402

WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def widget_models(nb, name):
    state = nb.metadata["widgets"][WIDGET_STATE]["state"]
    return [m["state"] for m in state.values() if m["model_name"] == name]


def test_the_example_notebook_runs_with_one_live_tab_per_rank():
    nb = nbformat.read(EXAMPLES / "quickstart.ipynb", as_version=4)
    notebook_client(nb, timeout=180).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    # The decorator's result, and the magic's last-expression values.
    assert code[1].outputs[-1]["data"]["text/plain"] == "[30.0, 30.0]"
    magic_result = code[3].outputs[-1]["data"]["text/plain"]
    assert magic_result.startswith("[0.00") and magic_result.count(",") == 1
    # Names assigned in the %%distributed cell came back and the next cell used them.
    assert "final loss 0.00" in "".join(o.get("text", "") for o in code[4].outputs)

    tabs = widget_models(nb, "TabModel")
    assert [t["titles"] for t in tabs] == [["rank 0 ✓", "rank 1 ✓"]] * 2
    texts = ["".join(o.get("text", "") for o in s["outputs"]) for s in widget_models(nb, "OutputModel")]
    assert "rank 0 of 2 on cpu\n" in texts and "rank 1 of 2 on cpu\n" in texts
    bars = [t for t in texts if "training [" in t]
    assert len(bars) == 2
    for bar in bars:  # redrawn in place: one line, the final state
        assert bar == "training [####################] step 20/20 loss 0.0029\n"
    headers = [h["value"] for h in widget_models(nb, "HTMLModel") if "rank(s)" in h["value"]]
    assert all("succeeded" in h for h in headers)


@pytest.fixture
def kernel():
    with Kernel() as k:
        yield k


def test_interrupting_the_kernel_stops_every_rank_and_the_kernel_stays_usable(kernel):
    kernel.run("%load_ext air_magic")
    pids: list[int] = []

    def watch(msg):
        if msg["msg_type"] == "stream":
            # Only the ranks' own lines: a rank's traceback after the interrupt quotes the cell's
            # source ("pid={os.getpid()}") as context.
            for found in re.finditer(r"pid=(\d+)$", msg["content"]["text"], re.MULTILINE):
                pids.append(int(found.group(1)))
                if len(pids) == 2:
                    kernel.km.interrupt_kernel()

    cell = (
        "%%distributed -n 2 --display text\n"
        "import os, time\n"
        "print(f'pid={os.getpid()}', flush=True)\n"
        "time.sleep(300)\n"
    )
    started = time.monotonic()
    reply, _ = kernel.run(cell, on_message=watch)
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
    assert time.monotonic() - started < 60
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(psutil.pid_exists(p) for p in pids)
    reply, _ = kernel.run("%distributed status")
    assert reply["status"] == "ok"
    reply, _ = kernel.run("assert 1 + 1 == 2")
    assert reply["status"] == "ok"


def test_after_a_failed_cell_the_kernel_runs_the_next_one(kernel):
    kernel.run("%load_ext air_magic")
    reply, _ = kernel.run("%%distributed -n 2\nraise ValueError('rank failure')\n")
    assert reply["status"] == "error" and reply["ename"] == "ValueError"
    assert any("rank 0 of 2" in line or "rank 1 of 2" in line for line in reply["traceback"])
    reply, _ = kernel.run("%%distributed -n 2\n3\n")
    assert reply["status"] == "ok"


@pytest.mark.fault(
    "100 000 lines into the live tabs of a kernel",
    "every line logged; a bounded number of messages to the browser",
)
def test_a_flood_of_output_keeps_every_line_and_bounds_the_kernels_messages(kernel):
    lines = 50_000
    kernel.run("%load_ext air_magic\nimport air_magic")
    started = time.monotonic()
    reply, counts = kernel.run(
        "%%distributed -n 2 --display tabs\n"
        "import os, sys\n"
        "r = os.environ['RANK']\n"
        f"for i in range({lines}):\n"
        "    sys.stdout.write(f'rank {r} line {i}\\n')\n",
        timeout=300,
    )
    elapsed = time.monotonic() - started
    assert reply["status"] == "ok"
    comm = counts.get("comm_msg", 0)
    print(f"\n{2 * lines} lines in {elapsed:.1f} s; kernel messages to the frontend: {counts}")
    # Updates are batched by time (every 0.25 s per tab), not sent per line.
    assert comm < 2 * lines / 100
    log_dir = kernel.printed("print(air_magic.last_run().log_dir)").strip()
    for rank in (0, 1):
        with open(os.path.join(log_dir, f"rank-{rank}.log")) as f:
            got = f.read().splitlines()
        assert got == [f"rank {rank} line {i}" for i in range(lines)]
