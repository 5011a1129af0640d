"""Threads of the caller's side, started in a copy of the starting thread's context.

ipykernel >= 7 keeps "which cell is this output for" in context variables; a plain
``threading.Thread`` starts with an empty context, so what it prints lands in
whichever cell happens to run. Every thread air_magic starts for a call (a
background call, MLflow's owner thread, the metric writer, the import of mlflow)
is started here, so its output goes to the cell of the call. Standard library only.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any


def start_in_context(target: Callable[..., Any], name: str, *args: Any) -> threading.Thread:
    """A started daemon thread running ``target(*args)`` in a copy of the caller's context."""
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(target, *args), name=name, daemon=True)
    thread.start()
    return thread
