"""Turn the user's function and arguments into one payload, checked before launch.

The payload is pickled once (not once per rank) into the run's private
directory, where every rank reads it. Two things fail here, before any
process starts: something that cannot be pickled (named by its path) and a
payload over the size limit (with its largest parts listed).

One version of the code: a function decorated in a module travels by value
(the module's attribute is the wrapper, not the function), while the
module's helpers travel by name and ranks import them from the file. If the
file was edited since the decorator ran (:func:`remember_module_file`), the
ranks would run the old body with the new helpers; the module is then
pickled by value for this payload, so ranks run what this kernel has loaded
(said once per edit, on stderr, with the reload that picks up the new one).
"""

from __future__ import annotations

import inspect
import linecache
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from air_magic.errors import PayloadError
from air_magic.protocol.serialization import (
    describe_type,
    dumps,
    find_unpicklable,
    modules_by_value,
    parts_of,
)


def build_payload(fn: Callable[..., Any], bound: inspect.BoundArguments, max_bytes: int) -> bytes:
    """Pickle ``(fn, args, kwargs)``; raise PayloadError naming what cannot travel."""
    with modules_by_value(_modules_edited_since_loaded(fn)):
        return _pickle_checked(fn, bound, max_bytes)


def _pickle_checked(fn: Callable[..., Any], bound: inspect.BoundArguments, max_bytes: int) -> bytes:
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


# --- a decorated function's module file, as it was when the decorator ran -------------


@dataclass(frozen=True)
class _LoadedFile:
    module: str
    path: str
    stamp: tuple[int, int] | None  # (st_mtime_ns, st_size); None once the file is gone


_loaded_files: weakref.WeakKeyDictionary[types.FunctionType, _LoadedFile] = weakref.WeakKeyDictionary()
_told: set[tuple[str, tuple[int, int] | None]] = set()  # (path, stamp) already said on stderr
_files_lock = threading.Lock()


def remember_module_file(func: Callable[..., Any]) -> None:
    """Note the state of the file ``func``'s module was loaded from (the decorator runs at import).

    The first record of a function stays: ``with_overrides`` after an edit
    must not pass the edited file off as the loaded one. A reload makes new
    function objects, hence new records.
    """
    if not isinstance(func, types.FunctionType):
        return
    path = _source_file(sys.modules.get(func.__module__ or ""))
    if path is None:
        return
    with _files_lock:
        if func not in _loaded_files:
            _loaded_files[func] = _LoadedFile(func.__module__, path, _stat(path))


def _source_file(module: types.ModuleType | None) -> str | None:
    """The ``.py`` file of a module loaded from one; not a notebook's or a script's ``__main__``."""
    if module is None or module.__name__ in ("__main__", "__mp_main__"):
        return None
    path = getattr(module, "__file__", None)
    return path if isinstance(path, str) and path.endswith(".py") else None


def _stat(path: str) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size


def _modules_edited_since_loaded(fn: Callable[..., Any]) -> list[types.ModuleType]:
    """``fn``'s module, if its file changed since the decorator ran (then it must travel by value)."""
    if not isinstance(fn, types.FunctionType):
        return []
    with _files_lock:
        loaded = _loaded_files.get(fn)
    module = sys.modules.get(loaded.module) if loaded is not None else None
    if loaded is None or module is None:
        return []
    now = _stat(loaded.path)
    if now == loaded.stamp:
        return []
    with _files_lock:
        first_time = (loaded.path, now) not in _told
        _told.add((loaded.path, now))
    if first_time:
        print(
            f"air_magic: {os.path.basename(loaded.path)} changed on disk since it was imported; ranks run "
            f"the version this kernel has loaded — importlib.reload({loaded.module}) to use the new one",
            file=sys.stderr,
        )
    return [module]
