"""The notebook's stop button, in a real kernel (issue 31, items 4 and 5).

On a one-off ``%%distributed`` cell the ranks get SIGINT (``KeyboardInterrupt``), as a
session's ranks do, so ``except KeyboardInterrupt: save()`` runs before the grace ends.
On a foreground ``--detach`` cell the button stops following: the run, detached to
outlive the kernel, goes on, and the message says how to re-attach or cancel it.
"""

from __future__ import annotations

import queue
import time

import pytest
from helpers.procs import gone_within

pytest.importorskip("ipykernel")
pytest.importorskip("jupyter_client")
from helpers.kernel import Kernel

import air_magic

fault = pytest.mark.fault

pytestmark = pytest.mark.serial  # a handler that must finish within the grace after the interrupt

SAVES_ON_INTERRUPT = """%%distributed -n 2 --no-tracking --display text{extra}
import os, time
rank = os.environ['RANK']
print(f'pid={{os.getpid()}}', flush=True)
try:
    time.sleep(300)
except KeyboardInterrupt:
    time.sleep(1.5)  # longer than the old 1 s grace: a checkpoint takes a while
    open(os.path.join({folder!r}, f'saved-{{rank}}'), 'w').close()
    print('saved', flush=True)
    raise
"""


def _pids_then_interrupt(kernel: Kernel, code: str) -> tuple[list[int], dict, list[str]]:
    msg_id = kernel.kc.execute(code)
    pids, lines = kernel.wait_for_pids(msg_id, 2)
    texts = [line + "\n" for line in lines]
    kernel.km.interrupt_kernel()
    reply = kernel.kc.get_shell_msg(timeout=60)
    assert reply["parent_header"]["msg_id"] == msg_id
    while True:  # what the cell printed to its end
        try:
            msg = kernel.kc.get_iopub_msg(timeout=5)
        except queue.Empty:
            break
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            texts.append(msg["content"]["text"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    return pids, reply["content"], texts


@fault(
    "the notebook's stop button on a one-off %%distributed cell",
    "every rank gets KeyboardInterrupt and its handler's checkpoint is written within the grace",
)
def test_the_stop_button_gives_the_ranks_keyboard_interrupt(tmp_path):
    with Kernel(cwd=tmp_path) as kernel:
        kernel.printed("%load_ext air_magic")
        code = SAVES_ON_INTERRUPT.format(extra="", folder=str(tmp_path))
        pids, reply, texts = _pids_then_interrupt(kernel, code)
        assert reply["ename"] == "KeyboardInterrupt"
        assert gone_within(pids)
        assert sorted(p.name for p in tmp_path.glob("saved-*")) == ["saved-0", "saved-1"], texts
        assert "[rank 0] saved" in "".join(texts) and "[rank 1] saved" in "".join(texts)


@fault(
    "the notebook's stop button on a foreground --detach cell",
    "the cell stops following; the detached run goes on; the message says how to attach or cancel",
)
def test_the_stop_button_on_a_detached_cell_stops_following_only(tmp_path):
    with Kernel(cwd=tmp_path) as kernel:
        kernel.printed("%load_ext air_magic")
        code = SAVES_ON_INTERRUPT.format(extra=" --detach", folder=str(tmp_path))
        pids, reply, texts = _pids_then_interrupt(kernel, code)
        run_id = (
            reply["evalue"].split("detached run ")[1].split(";")[0]
            if "detached run " in reply["evalue"]
            else ""
        )
        try:
            assert (
                reply["ename"] == "KeyboardInterrupt" and "stopped following detached run" in reply["evalue"]
            )
            said = "".join(texts)
            assert "air_magic.attach(" in said and "cancel" in said, said
            (run,) = [r for r in air_magic.runs() if r.id == run_id]
            assert run.status == "running"
            time.sleep(2)
            assert not list(tmp_path.glob("saved-*"))  # the ranks were never interrupted
        finally:
            if run_id:  # never left running for 300 s, whatever failed above
                assert air_magic.attach(run_id, display="none").cancel() is True
        assert gone_within(pids)
        assert sorted(p.name for p in tmp_path.glob("saved-*")) == ["saved-0", "saved-1"]
