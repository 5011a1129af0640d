"""How a forked (warm) rank ends: the way a Python process ends, without tearing down the starter's heap.

A fresh rank ends with the interpreter's own shutdown (``SystemExit``, see
worker/entry.py). A rank forked by the warm starter could too, but then every
object the starter made on import (torch's, hundreds of thousands) is
deallocated, and every deallocation writes to a page the fork still shares
with the starter: about 0.2 s of copy-on-write faults per rank for nothing the
user can see. So a forked rank runs the steps of ``Py_FinalizeEx`` that the
user can see, in its order, on what the rank itself made, then ``os._exit``:

1. wait for non-daemon threads (``threading._shutdown``, as the interpreter does);
2. run ``atexit`` hooks (the user's, torch's, air_magic's last one);
3. clear the modules the rank imported itself, newest first, as the
   interpreter's module teardown does (``_`` names first), then collect
   the rank's own garbage: ``__del__`` methods and ``weakref.finalize`` run,
   files held in module globals are flushed and closed;
4. close files still open anywhere else (held by a frozen structure or a daemon
   thread's frame), outermost layer first, and flush stdout and stderr.

What the starter preloaded (``preloaded``) is left as it is, and so are the
``weakref.finalize`` hooks it registered (the starter turns them off before it
forks: torch's spend 60 ms unregistering operator libraries from a process that
is ending). Python never promised ``__del__`` for objects still alive at exit.
tests/process/test_warm_equals_fresh.py runs the same probes in both modes.
"""

from __future__ import annotations

import _io
import atexit
import gc
import os
import sys
import threading
from collections.abc import Iterable
from types import ModuleType
from typing import Any, NoReturn

# The C base classes of every io object, open() files and Python subclasses (GzipFile) alike.
# Checked through the type's MRO, never isinstance: an ABC check can run user code.
_IOBASE, _TEXT, _BUFFERED = _io._IOBase, _io._TextIOBase, _io._BufferedIOBase


def end_forked_rank(code: Any, preloaded: Iterable[str]) -> NoReturn:
    """End this forked rank with exit status ``code`` (a ``SystemExit.code``), like Python would."""
    status = _status(code)
    try:
        _join_non_daemon_threads()
        atexit._run_exitfuncs()
        left_alone = set(preloaded)
        _clear_modules([m for m in reversed(list(sys.modules)) if m not in left_alone])
        gc.collect()
        _close_open_files()
    except BaseException:  # noqa: BLE001 - as at a real exit, a failing step is said, not fatal
        import traceback

        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - best effort while exiting
            pass
    os._exit(status)


def _status(code: Any) -> int:
    """The exit status Python gives ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _join_non_daemon_threads() -> None:
    shutdown = getattr(threading, "_shutdown", None)  # what Py_FinalizeEx calls first, 3.10-3.13
    if shutdown is not None:
        shutdown()
        return
    for thread in threading.enumerate():  # pragma: no cover - a Python without it
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()


def _clear_modules(names: list[str]) -> None:
    """Drop the rank's own modules' globals the way the interpreter's teardown does."""
    for name in names:
        module = sys.modules.get(name)
        if not isinstance(module, ModuleType) or name in ("__main__", "builtins", "sys"):
            continue
        namespace = module.__dict__
        for first_pass in (True, False):
            for key in list(namespace):
                if key == "__builtins__" or (first_pass and not (key.startswith("_") and key[1:2] != "_")):
                    continue
                try:
                    namespace[key] = None
                except Exception:  # noqa: BLE001 - a module's odd dict: leave it
                    pass


def _io_layer(obj: object) -> int | None:
    """0 for a text file, 1 a buffered one, 2 another file object; None for anything else."""
    try:
        mro = type(obj).__mro__
        # By identity: a metaclass's __eq__ may raise as well.
        if not any(c is _IOBASE for c in mro):
            return None
        return 0 if any(c is _TEXT for c in mro) else 1 if any(c is _BUFFERED for c in mro) else 2
    except Exception:  # noqa: BLE001 - some frameworks' types have none (transformers, Lightning)
        return None


def _close_open_files() -> None:
    keep = {id(sys.stdout), id(sys.stderr), id(sys.stdin), id(sys.__stdout__), id(sys.__stderr__)}
    layers = []
    for obj in gc.get_objects():
        layer = _io_layer(obj)
        if layer is not None and id(obj) not in keep:
            layers.append((layer, obj))
    # A text layer flushes into its buffer, a buffer into its raw file: close outermost first.
    layers.sort(key=lambda pair: pair[0])
    for _, obj in layers:
        try:
            if not obj.closed and getattr(obj, "fileno", lambda: -1)() not in (0, 1, 2):
                obj.close()
        except Exception:  # noqa: BLE001 - a closed or detached layer; the next one closes it
            pass
