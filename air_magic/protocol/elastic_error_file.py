"""torchrun's per-rank error file (``TORCHELASTIC_ERROR_FILE``), read as a rank's error record.

torchrun gives each rank a path in this variable; torch's
``torch.distributed.elastic.multiprocessing.errors.record`` decorator (torchtitan's
``main`` uses it) writes the failing rank's exception there as JSON before re-raising.
Each rank gets one in its call folder (launch/rank_env.py). The rank's own report
(``wire.error_path``) is richer (the exception itself travels) and wins; the error
file speaks for a rank that ended without one (a hard ``os._exit`` after ``@record``,
a binary under ``--no-python`` that writes it). Its JSON, as torch writes it::

    {"message": {"message": "ValueError: loss nan",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1764892800"}}}
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from air_magic.protocol import serialization
from air_magic.protocol.wire import ErrorRecord

STAGE = "error-file"  # the record's stage: the caller's error says where its text came from


def error_file_path(call_dir: str, rank: int) -> str:
    return os.path.join(call_dir, f"torchelastic-error-{rank}.json")


def record_from_error_file(path: str, rank: int) -> bytes | None:
    """The rank's error record (serialized) from the error file at ``path``; None if it wrote none."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            data = json.load(f)
        written = os.stat(path).st_mtime
    except (OSError, ValueError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    extra: dict[str, Any] = {}
    if isinstance(message, str):  # the newer shape: the message alone
        text = message
    elif isinstance(message, dict):
        text = str(message.get("message", ""))
        if isinstance(message.get("extraInfo"), dict):
            extra = message["extraInfo"]
    else:
        return None
    type_name, found, rest = text.partition(": ")
    if not found or not type_name.replace(".", "").replace("_", "").isalnum():
        type_name, rest = "Exception", text
    return serialization.dumps(
        ErrorRecord(
            rank=rank,
            # One clock with the other ranks' records (monotonic): when the file was written.
            time=time.monotonic() - max(0.0, time.time() - written),
            stage=STAGE,
            type_name=type_name,
            message=rest,
            traceback=str(extra.get("py_callstack") or f"{text}\n"),
            exception=None,
        )
    )
