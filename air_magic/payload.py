"""Turn the user's function and arguments into one payload, checked before launch.

The payload is pickled once (not once per rank) into the run's private
directory, where every rank reads it. Two things fail here, before any
process starts: something that cannot be pickled (named by its path) and a
payload over the size limit (with its largest parts listed).
"""

from __future__ import annotations

import inspect
import linecache
from collections.abc import Callable
from typing import Any

from air_magic.errors import PayloadError
from air_magic.serialization import describe_type, dumps, find_unpicklable, parts_of


def build_payload(fn: Callable[..., Any], bound: inspect.BoundArguments, max_bytes: int) -> bytes:
    """Pickle ``(fn, args, kwargs)``; raise PayloadError naming what cannot travel."""
    parts = _named_parts(fn, bound)
    try:
        data = dumps((fn, bound.args, bound.kwargs, cell_sources()))
    except Exception as exc:
        for path, obj in parts:
            found = find_unpicklable(obj, path)
            if found is not None:
                where, error = found
                raise PayloadError(
                    f"cannot send {where} to the ranks: {error}. "
                    "Objects such as open files, locks, sockets, database connections and "
                    "generators cannot be pickled; create them inside the function instead."
                ) from exc
        raise PayloadError(f"cannot send the function and its arguments to the ranks: {exc}") from exc
    if len(data) > max_bytes:
        # The function's own closure variables and globals are listed one by one: that is
        # where a notebook's big data usually hides.
        fn_path, fn_obj = parts[-1]
        candidates = parts[:-1] + list(parts_of(fn_obj, fn_path))
        sizes = sorted(((len(_dumps_or_empty(obj)), path) for path, obj in candidates), reverse=True)
        largest = "; ".join(f"{path}: {_mb(size)}" for size, path in sizes[:5] if size)
        raise PayloadError(
            f"the function and its arguments pickle to {_mb(len(data))}, over the limit of "
            f"{_mb(max_bytes)} (max_payload_bytes). Largest parts: {largest}. Every rank would "
            "load a copy: load data inside the function instead (from files or a dataset), or "
            "raise max_payload_bytes if you mean it."
        )
    return data


def _named_parts(fn: Callable[..., Any], bound: inspect.BoundArguments) -> list[tuple[str, Any]]:
    parts: list[tuple[str, Any]] = [(f"argument {name!r}", value) for name, value in bound.arguments.items()]
    parts.append((f"function {getattr(fn, '__qualname__', describe_type(fn))!r}", fn))
    return parts


def _dumps_or_empty(obj: Any) -> bytes:
    try:
        return dumps(obj)
    except Exception:  # noqa: BLE001 - sizing only
        return b""


def _mb(size: int) -> str:
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 1024:.1f} KiB"


_MAX_SOURCES = 2 * 2**20


def cell_sources() -> dict[str, list[str]]:
    """Source lines of code that has no file (notebook and IPython cells), newest first, capped.

    IPython registers each cell in ``linecache`` with no modification time; a
    rank gets the same entries, so its traceback shows the lines of the cell
    it came from instead of bare line numbers.
    """
    sources: dict[str, list[str]] = {}
    total = 0
    # dict.copy() is one step under the GIL; other threads (warnings, logging) also use linecache.
    for name, entry in reversed(list(linecache.cache.copy().items())):
        if len(entry) != 4 or entry[1] is not None:
            continue
        lines = list(entry[2])
        total += sum(len(line) for line in lines)
        if total > _MAX_SOURCES:
            break
        sources[name] = lines
    return sources
