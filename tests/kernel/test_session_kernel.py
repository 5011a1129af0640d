"""A persistent session in a real Jupyter kernel (SPEC §15): a notebook run by nbclient, the stop
button mid-cell, and a kernel restart with a session up."""

from __future__ import annotations

import json

import pytest
from helpers.modules import lazy, skip_unless_installed
from helpers.procs import gone_within

pytestmark = skip_unless_installed("nbformat", "nbclient", "ipywidgets")
nbformat = lazy("nbformat")
from helpers.kernel import Kernel, notebook_client  # noqa: E402

fault = pytest.mark.fault

CELLS = [
    "%load_ext air_magic",
    "%distributed session start -n 2 --no-tracking",
    "%%distributed\nimport os\nmodel = {'rank': int(os.environ['RANK']), 'steps': 0}\nprint('built', model)",
    "%%distributed\nmodel['steps'] += 1\nmodel['rank'], model['steps']",
    (
        "%%distributed\nimport os\nif os.environ['RANK'] == '1':\n    raise KeyError('only rank 1')\n",
        "raises",
    ),
    "%%distributed\nmodel['steps'] += 1\nmodel['rank'] * 10 + model['steps']",
    "print('notebook has', model)\n%distributed session status",
    "%%distributed --pull model\npass",
    # The headers as the kernel holds them (nbclient keeps only the widget messages of the cell it runs).
    "import json, ipywidgets\nfrom ipywidgets.widgets.widget import _instances\n"
    "print(json.dumps([w.value for w in list(_instances.values()) if isinstance(w, ipywidgets.HTML)]))\n"
    "print(model)",
    ("%%distributed --timeout 2\nimport time\nprint('waiting', flush=True)\ntime.sleep(60)", "raises"),
    "%%distributed\nmodel['steps']",
    (
        "%%distributed\nimport os, signal, time\nif os.environ['RANK'] == '1':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(60)",
        "raises",
    ),
    "%distributed session status\n%distributed session stop",
]


def _cell(source: str | tuple[str, str]) -> object:
    if isinstance(source, tuple):
        return nbformat.v4.new_code_cell(source[0], metadata={"tags": ["raises-exception"]})
    return nbformat.v4.new_code_cell(source)


def _text(cell: object) -> str:
    return "".join(o.get("text", "") for o in cell.outputs)  # type: ignore[attr-defined]


def test_a_notebook_session_through_a_failing_cell_a_timeout_and_a_dead_rank(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[_cell(c) for c in CELLS])
    notebook_client(nb, timeout=180, path=tmp_path).execute()
    code = nb.cells
    assert "application/vnd.jupyter.widget-view+json" in json.dumps(code[2].outputs)  # the cell's tabs
    assert code[3].outputs[-1]["data"]["text/plain"] == "[(0, 1), (1, 1)]"
    error = next(o for o in code[4].outputs if o["output_type"] == "error")
    assert error["ename"] == "KeyError" and "only rank 1" in error["evalue"]
    assert "raise KeyError" in "\n".join(error["traceback"])  # the rank's own traceback
    assert code[5].outputs[-1]["data"]["text/plain"] == "[2, 12]"  # the session lived on
    # The ranks' own `model` is not watched (it would be pickled at every cell): the notebook keeps
    # the copy the first cell brought back until --pull asks for rank 0's.
    assert "notebook has {'rank': 0, 'steps': 0}" in _text(code[6])
    assert "brought back from rank 0: model" in _text(code[7])
    status = _text(code[6])
    assert "ready, 2 rank(s), 4 cell(s) run" in status and "resident" in status, status
    headers = json.loads(_text(code[8]).splitlines()[0])
    assert any("cell 4;" in h and "rank 1 (pid" in h for h in headers), headers  # the session, in the header
    assert "{'rank': 0, 'steps': 2}" in _text(code[8])
    # A cell that hangs hits its timeout: the ranks' last lines and stacks; interrupted; the session goes on
    error = next(o for o in code[9].outputs if o["output_type"] == "error")
    assert error["ename"] == "DistributedTimeoutError" and "goes on" in error["evalue"], error
    assert "waiting" in error["evalue"] and "stacks.txt" in error["evalue"]
    assert code[10].outputs[-1]["data"]["text/plain"] == "[2, 2]"
    # A rank that dies ends the session with a clear message; nothing is left
    error = next(o for o in code[11].outputs if o["output_type"] == "error")
    assert error["ename"] == "SessionEndedError", error
    assert "rank 1" in error["evalue"] and "SIGKILL" in error["evalue"] and "session start" in error["evalue"]
    ended = _text(code[12])
    assert ": ended, 2 rank(s)" in ended and "SIGKILL" in ended, ended
    assert "no session is running" in ended


@fault(
    "the notebook's stop button mid-cell in a session",
    "KeyboardInterrupt in every rank; the session and its state live on",
)
def test_the_stop_button_interrupts_the_cell_and_keeps_the_session(tmp_path):
    with Kernel(cwd=tmp_path) as kernel:
        kernel.printed("%load_ext air_magic\n%distributed session start -n 2 --no-tracking --display text")
        kernel.printed("%%distributed\nkept = 41\n")
        msg_id = kernel.kc.execute(
            "%%distributed --display text\nimport os, time\nprint(f'pid={os.getpid()}', flush=True)\n"
            "time.sleep(300)\n"
        )
        pids, lines = kernel.wait_for_pids(msg_id, 2)
        kernel.km.interrupt_kernel()
        reply = kernel.kc.get_shell_msg(timeout=60)
        assert reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        reply, _ = kernel.run_after_interrupt("1 + 1")
        assert reply["status"] == "ok", reply
        kernel.printed("%%distributed --display none\nimport os\n(kept + 1, os.getpid())")
        values = json.loads(
            kernel.printed("import json, air_magic\nprint(json.dumps(air_magic.last_run().values))")
        )
        # the same ranks (the pids came in the order the ranks printed), their state kept. (Once in
        # a CI simulation under load the pids differed with the values right: what it printed and the
        # session's state say why, if it comes again.)
        status = (
            kernel.printed("%distributed session status")
            if sorted(v[1] for v in values) != sorted(pids)
            else ""
        )
        assert [v[0] for v in values] == [42, 42] and sorted(v[1] for v in values) == sorted(pids), (
            lines,
            status,
        )
        kernel.printed("%distributed session stop")
        assert gone_within(pids)


@fault("kernel restart with a session up", "every session rank gone within 5 s")
def test_a_kernel_restart_leaves_no_session_rank(tmp_path):
    with Kernel(cwd=tmp_path) as kernel:
        kernel.printed("%load_ext air_magic\n%distributed session start -n 2 --no-tracking --display none")
        out = kernel.printed("%%distributed --display text\nimport os\nprint(f'pid={os.getpid()}')\n")
        pids = [int(line.split("pid=")[1]) for line in out.splitlines() if "pid=" in line]
        assert len(pids) == 2
        kernel.restart_in_background()
        assert gone_within(pids)
        kernel.wait_restarted()
