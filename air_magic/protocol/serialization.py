"""Serialisation of what travels between the caller and the ranks.

Shared by both sides (the worker imports it), so it depends only on the
standard library and cloudpickle. Functions and classes defined in a notebook
(``__main__``) travel by value, as cloudpickle does by default; those of an
importable module by reference, unless :func:`modules_by_value` says otherwise
for the length of one pickling (a module edited on disk since it was loaded).

When something cannot be pickled, :func:`find_unpicklable` walks into it
(arguments, closure cells, referenced globals, attributes, items) and names
the deepest part that fails, e.g. ``argument 'model' -> .lock``.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import pickle
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any, ClassVar

import cloudpickle

PROTOCOL = pickle.HIGHEST_PROTOCOL
_MAX_DEPTH = 6  # deep enough to name model.layers[3].hook; shallow enough to stay instant
_CLOUDPICKLE_CODE_REDUCE = cloudpickle.Pickler.dispatch_table[types.CodeType]


def _code_reduce_keeping_filename(code: types.CodeType) -> Any:
    """cloudpickle's code reducer, but keeping ``co_filename``.

    cloudpickle 3.1 renames every by-value code object to ``<dynamic-code>``
    (for deterministic pickles); a rank's traceback would then lose the file
    and line the user wrote. Determinism does not matter here; tracebacks do.
    """
    constructor, args = _CLOUDPICKLE_CODE_REDUCE(code)
    args = tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)
    return constructor, args


class Pickler(cloudpickle.Pickler):
    dispatch_table: ClassVar[collections.ChainMap[Any, Any]] = collections.ChainMap(
        {types.CodeType: _code_reduce_keeping_filename}, cloudpickle.Pickler.dispatch_table
    )


def dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    Pickler(buffer, protocol=PROTOCOL).dump(obj)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    return pickle.loads(data)


# cloudpickle's by-value registry is one set for the whole process: count who asked, so
# that two threads pickling at once do not unregister a module under each other's feet.
_by_value_lock = threading.Lock()
_by_value_holds: collections.Counter[str] = collections.Counter()


@contextlib.contextmanager
def modules_by_value(modules: list[types.ModuleType]) -> Iterator[None]:
    """Inside the block, pickle these modules' functions and classes by value, not by name.

    A module the user registered with cloudpickle themselves stays registered.
    """
    held: list[types.ModuleType] = []
    with _by_value_lock:
        for module in modules:
            name = module.__name__
            if _by_value_holds[name] == 0 and name in cloudpickle.list_registry_pickle_by_value():
                continue  # the user's own registration: not ours to undo
            if _by_value_holds[name] == 0:
                cloudpickle.register_pickle_by_value(module)
            _by_value_holds[name] += 1
            held.append(module)
    try:
        yield
    finally:
        with _by_value_lock:
            for module in held:
                name = module.__name__
                _by_value_holds[name] -= 1
                if _by_value_holds[name] == 0:
                    del _by_value_holds[name]
                    with contextlib.suppress(ValueError):  # unregistered meanwhile by someone else
                        cloudpickle.unregister_pickle_by_value(module)


def find_unpicklable(obj: Any, path: str, depth: int = 0) -> tuple[str, BaseException] | None:
    """Return ``(path, error)`` for the deepest part of ``obj`` that fails to pickle."""
    try:
        dumps(obj)
        return None
    except Exception as exc:  # noqa: BLE001 - any pickling failure is what we look for
        error: BaseException = exc
    if depth >= _MAX_DEPTH:
        return path, error
    for child_path, child in parts_of(obj, path):
        found = find_unpicklable(child, child_path, depth + 1)
        if found is not None:
            return found
    return path, error


def parts_of(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    """The parts of ``obj`` that pickling would visit, with readable paths."""
    if isinstance(obj, types.FunctionType):
        code = obj.__code__
        for name, cell in zip(code.co_freevars, obj.__closure__ or (), strict=False):
            try:
                yield f"{path} -> closure variable {name!r}", cell.cell_contents
            except ValueError:  # empty cell
                continue
        # Only globals the function reads; modules are pickled by reference.
        for name in _global_names(code):
            if name in obj.__globals__ and not isinstance(obj.__globals__[name], types.ModuleType):
                yield f"{path} -> global {name!r}", obj.__globals__[name]
        return
    if isinstance(obj, dict):
        for key, value in list(obj.items())[:1000]:
            yield f"{path}[{key!r}]", value
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for i, value in enumerate(list(obj)[:1000]):
            yield f"{path}[{i}]", value
        return
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        for key, value in state.items():
            yield f"{path}.{key}", value


def _global_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def describe_type(obj: Any) -> str:
    cls = type(obj)
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


# --- results: tensors come back on the CPU -----------------------------------------


class _CPUPickler(Pickler):
    """Pickles results with every torch tensor moved to the CPU first.

    The caller must never touch a GPU (it would create a CUDA context in the
    notebook), so device tensors are copied to host memory in the rank.
    """

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            return _identity, (obj.detach().cpu(),)
        return super().reducer_override(obj)


def _identity(value: Any) -> Any:
    return value


def dumps_result(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _CPUPickler(buffer, protocol=PROTOCOL).dump(obj)
    return buffer.getvalue()


# --- fingerprints: did a value sent to a cell change there? --------------------------


class _FingerprintPickler(_CPUPickler):
    """Pickles data as usual, but each function and class as its identity.

    A notebook function sent by value carries the globals it reads: pickled as
    code, it would look changed whenever the cell rebinds one of them, though
    the function itself did not change. Only the data is compared.
    """

    def reducer_override(self, obj: Any) -> Any:
        if obj is not _code_identity and isinstance(obj, (type, types.FunctionType)):
            return _code_identity, (id(obj),)
        return super().reducer_override(obj)


def _code_identity(key: int) -> int:
    return key


class TooLargeToFingerprint(Exception):
    """The value's pickle passed the limit given to :func:`fingerprint` (it was not finished)."""


class _DigestSink:
    """A file-like target that hashes what is written: a large value is never held twice."""

    def __init__(self, limit: int | None = None) -> None:
        self.hash = hashlib.blake2b(digest_size=16)
        self.limit = limit
        self.size = 0

    def write(self, data: bytes) -> int:
        self.size += len(data)
        if self.limit is not None and self.size > self.limit:
            raise TooLargeToFingerprint(self.size)
        self.hash.update(data)
        return len(data)


def fingerprint(obj: Any, limit: int | None = None) -> bytes:
    """A digest of ``obj``'s data, equal before and after exactly when its pickle is.

    ``limit``: bytes of pickle after which it gives up (:class:`TooLargeToFingerprint`)."""
    sink = _DigestSink(limit)
    _FingerprintPickler(sink, protocol=PROTOCOL).dump(obj)
    return sink.hash.digest()
