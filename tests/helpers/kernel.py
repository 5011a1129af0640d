"""Jupyter kernels and IPython shells for tests: one copy of each helper, shared by every test file.

- ``Kernel``: a kernel driven message by message (for what nbclient does not expose), restarted
  beside the test with ``restart_in_background`` / ``wait_restarted``; ``wait_for_pids`` reads
  the ranks' ``pid=N`` lines of a running cell.
- ``notebook_client``: nbclient's client for a notebook, with widget state stored.
- ``kernel_pid``: a kernel manager's pid, read guarded.
- ``air_magic_shell``: IPython's shell with the extension loaded, unloaded afterwards.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from helpers.paths import EXAMPLES

RESTART_WAIT_S = 60.0  # a restart is a kill and a new kernel's start (a few s; more on a busy 2-core machine)


def kernel_pid(km: Any) -> int | None:
    """The pid of a kernel manager's kernel; None while it has no process (read guarded).

    Never call this while another thread restarts the kernel: the provisioner's process is
    replaced there (see ``Kernel.restart_in_background``).
    """
    process = getattr(getattr(km, "provisioner", None), "process", None)
    return getattr(process, "pid", None)


class Kernel:
    """A kernel driven message by message, for what nbclient does not expose.

    ``cwd=None`` starts the kernel in this process's folder; ``env`` replaces its environment.
    Use it as a context manager, or call ``close()``.
    """

    def __init__(self, cwd: Path | None = EXAMPLES, env: dict[str, str] | None = None):
        options: dict[str, Any] = {}
        if cwd is not None:
            options["cwd"] = str(cwd)
        if env is not None:
            options["env"] = env
        from jupyter_client.manager import start_new_kernel  # here: collection stays cheap

        self.km, self.kc = start_new_kernel(kernel_name="python3", **options)
        self._restart: threading.Thread | None = None
        self._restart_error: Exception | None = None

    def __enter__(self) -> Kernel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        """The kernel's pid. Not while a restart runs: call ``wait_restarted()`` first."""
        assert self._restart is None, "the kernel is restarting: call wait_restarted() before reading its pid"
        return kernel_pid(self.km)

    def restart_in_background(self) -> None:
        """Restart the kernel (``now=True``) in a thread, so the test can watch the ranks meanwhile.

        ``restart_kernel`` kills the old process and starts a new one, replacing the kernel
        manager's process state as it goes: until ``wait_restarted()`` returns, the test must not
        touch ``km`` or ``kc`` (``pid`` refuses).
        """
        assert self._restart is None, "a restart is already running"
        self._restart_error = None

        def restart() -> None:
            try:
                self.km.restart_kernel(now=True)
            except Exception as error:  # noqa: BLE001 - wait_restarted() raises it in the test's thread
                self._restart_error = error

        self._restart = threading.Thread(target=restart, name="kernel-restart", daemon=True)
        self._restart.start()

    def wait_restarted(self, timeout: float = RESTART_WAIT_S) -> int:
        """Wait (bounded) until the restart is done and the new kernel answers; return its pid."""
        thread = self._restart
        assert thread is not None, "no restart was started"
        deadline = time.monotonic() + timeout
        thread.join(timeout)
        assert not thread.is_alive(), f"the kernel did not restart within {timeout} s"
        self._restart = None
        if self._restart_error is not None:
            raise AssertionError("the kernel's restart failed") from self._restart_error
        # The new process exists (restart_kernel returned); now wait for it to answer on its channels.
        self.kc.wait_for_ready(timeout=max(deadline - time.monotonic(), 1.0))
        pid = self.pid
        assert pid is not None and self.km.is_alive(), "the restarted kernel is not running"
        return pid

    def run(
        self, code: str, timeout: float = 120, on_message: Callable[[dict], None] | None = None
    ) -> tuple[dict, dict[str, int]]:
        """Execute ``code``; return its reply's content and the count of its iopub messages by type.

        ``on_message`` sees each iopub message of this execution as it comes.
        """
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
            while reply is None:
                try:
                    shell = self.kc.get_shell_msg(timeout=0.01)
                except queue.Empty:
                    break
                # Skip replies to earlier requests (wait_for_ready may leave kernel_info replies).
                if shell["parent_header"].get("msg_id") == msg_id:
                    reply = shell
        return reply["content"], counts

    def wait_for_pids(self, msg_id: str, count: int, timeout: float = 90) -> tuple[list[int], list[str]]:
        """Read the output of execution ``msg_id`` until ``count`` lines said ``pid=N``.

        Returns those pids and every line printed so far (for what else the lines carry).
        The execution goes on: the caller decides what happens next (interrupt, shutdown, ...)."""
        pids: list[int] = []
        lines: list[str] = []
        deadline = time.monotonic() + timeout
        while len(pids) < count:
            assert time.monotonic() < deadline, f"the ranks did not print their pids: {lines}"
            try:
                msg = self.kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id or msg["msg_type"] != "stream":
                continue
            for line in msg["content"]["text"].splitlines():
                lines.append(line)
                if "pid=" in line:
                    pids.append(int(line.split("pid=")[1].split()[0]))
        return pids, lines

    def run_after_interrupt(self, code: str, timeout: float = 120) -> tuple[dict, dict[str, int]]:
        """``run`` for the first request after an interrupted cell. ipykernel 7 aborts execute
        requests until a "stop aborting" message it queues after the error reaches the shell; in
        two CI simulations under load (a Ray head beside) a request sent seconds later was still
        answered "aborted". Sent again then, as a user would run the cell again; said in the output."""
        for _ in range(3):
            reply, counts = self.run(code, timeout=timeout)
            if reply["status"] != "aborted":
                break
            print("ipykernel aborted the first request after the interrupt: sent again")
            time.sleep(1)
        return reply, counts

    def printed(self, code: str, timeout: float = 120) -> str:
        """Execute ``code``, which must succeed; return all it printed (stdout and stderr streams)."""
        texts: list[str] = []

        def keep(msg: dict) -> None:
            if msg["msg_type"] == "stream":
                texts.append(msg["content"]["text"])

        reply, _ = self.run(code, timeout=timeout, on_message=keep)
        assert reply["status"] == "ok", reply
        return "".join(texts)

    def close(self) -> None:
        if self._restart is not None:  # a test that failed mid-restart: let the restart end first
            self._restart.join(RESTART_WAIT_S)
            self._restart = None
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def notebook_client(nb: Any, timeout: float, path: Path | str = EXAMPLES) -> Any:
    """nbclient's client for ``nb``, run in ``path`` by the python3 kernel, with widget state stored."""
    import nbclient

    return nbclient.NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        store_widget_state=True,
        resources={"metadata": {"path": path}},
    )


@contextlib.contextmanager
def air_magic_shell() -> Iterator[Any]:
    """IPython's shell (the process's one instance) with ``%load_ext air_magic``; unloaded afterwards."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "air_magic")
    try:
        yield shell
    finally:
        shell.run_line_magic("unload_ext", "air_magic")
