"""A Jupyter kernel driven message by message, for tests that nbclient does not cover."""

from __future__ import annotations

import queue
import time
from pathlib import Path

from jupyter_client.manager import start_new_kernel

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"


class Kernel:
    """A kernel driven message by message, for what nbclient does not expose."""

    def __init__(self, cwd: Path = EXAMPLES):
        self.km, self.kc = start_new_kernel(kernel_name="python3", cwd=str(cwd))

    @property
    def pid(self) -> int | None:
        """The kernel's pid; None while a restart has no process yet (read it guarded)."""
        provisioner = self.km.provisioner
        process = getattr(provisioner, "process", None) if provisioner is not None else None
        return None if process is None else process.pid

    def run(self, code, timeout=120, on_message=None):
        msg_id = self.kc.execute(code)
        counts: dict[str, int] = {}
        reply = None
        deadline = time.monotonic() + timeout
        idle = False
        while not (idle and reply is not None):
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; messages so far {counts}"
            try:
                msg = self.kc.get_iopub_msg(timeout=min(left, 1))
            except queue.Empty:
                msg = None
            if msg is not None and msg["parent_header"].get("msg_id") == msg_id:
                counts[msg["msg_type"]] = counts.get(msg["msg_type"], 0) + 1
                if on_message:
                    on_message(msg)
                if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    idle = True
            if reply is None:
                try:
                    reply = self.kc.get_shell_msg(timeout=0.01)
                except queue.Empty:
                    pass
        return reply["content"], counts

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)
