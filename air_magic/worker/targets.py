"""Inside a rank: what ``air-magic run TARGET`` runs there (a script, a module, or one function).

The command line (``cli.py``) sends one of these functions as the call's
function; they travel by reference (this module exists in every rank). A
script or module runs as ``__main__`` with ``sys.argv`` as it would under
``python`` or torchrun, so a script written for torchrun runs unchanged;
``sys.exit(0)`` (or ``None``) at its end is a success, another code a failure
with that status.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import runpy
import sys
from typing import Any


def run_script(path: str, argv: list[str], typed: str | None = None) -> None:
    """``python path argv...``: its folder first on ``sys.path``, run as ``__main__``; ``sys.argv[0]``
    is the path as the user typed it (``typed``), as under python and torchrun."""
    sys.argv = [typed or path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    if path.endswith(".py") and os.path.isfile(path):
        _as_main(lambda: _run_file_as_main(os.path.abspath(path)))
    else:  # a folder or zip file with a __main__.py: runpy's way (it sets sys.argv[0] to the path)
        _as_main(lambda: runpy.run_path(path, run_name="__main__"))


def _run_file_as_main(path: str) -> None:
    """``python path``: the file's code in a new ``__main__`` module, ``__file__`` absolute (as
    Python >= 3.9 sets it) and ``sys.argv[0]`` left as it is (``runpy.run_path`` would set it to
    ``path``, where python and torchrun keep it as typed). The old ``__main__`` comes back after."""
    import importlib.machinery
    import io
    import types

    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)  # bytes: the coding cookie holds
    module = types.ModuleType("__main__")
    module.__dict__.update(
        __file__=path,
        __cached__=None,
        __package__=None,
        __spec__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path),
    )
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved
        else:
            sys.modules.pop("__main__", None)


def run_module(module: str, argv: list[str]) -> None:
    """``python -m module argv...``."""
    sys.argv = [module, *argv]  # runpy puts the module's file in argv[0], as python -m does
    sys.path.insert(0, os.getcwd())
    _as_main(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))


def run_program(program: str, argv: list[str]) -> None:
    """``program argv...`` (torchrun's ``--no-python``): a child of the rank, in its process group,
    so a stop reaches it; the program's exit (a status or a signal) is the rank's."""
    import signal
    import subprocess

    child = subprocess.Popen([program, *argv])
    # A stop signals the rank's whole process group, the program with it: the rank waits for the
    # program to end in its own time (its grace), never killing it itself. A Python handler, not
    # SIG_IGN, which the program would inherit through exec.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda *_: None)
    status = child.wait()
    if status < 0:  # killed by a signal: the rank ends the same way
        if status not in (-signal.SIGKILL, -signal.SIGSTOP):
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    if status != 0:
        raise ScriptExit(status)


def call_function(spec: str, argv: list[str]) -> Any:
    """``module:function``, called with the arguments (strings); its return value comes back."""
    module_name, _, qualname = spec.partition(":")
    sys.path.insert(0, os.getcwd())
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    result = target(*argv)
    if inspect.iscoroutine(result):  # an ``async def`` target: run it to its end, as asyncio.run(main())
        result = asyncio.run(result)
    return result


class ScriptExit(Exception):
    """The script called ``sys.exit(status)`` with a failure: the command line exits with ``status``."""

    def __init__(self, status: int, message: str = ""):
        super().__init__(status, message)
        self.status = status
        self.message = message

    @property
    def exit_status(self) -> int:
        """The process's status, as a shell sees it: the low byte, never 0 for a failure."""
        return self.status & 0xFF or 1

    def __str__(self) -> str:
        said = f": {self.message}" if self.message else ""
        return f"the script exited with status {self.status}{said}"


def _as_main(run: Any) -> None:
    try:
        run()
    except SystemExit as exc:
        if exc.code is None or exc.code == 0:
            return  # the way a script says it succeeded
        if isinstance(exc.code, int):
            raise ScriptExit(exc.code) from None
        raise ScriptExit(1, str(exc.code)) from None  # sys.exit("message"): Python prints it, status 1
