"""Inside a rank: the ``__main__`` module that the user's names live in, as under torchrun's script.

``pickle`` (and so ``torch.save``, ``multiprocessing``, a DataLoader's workers) finds a class or
function by ``sys.modules[obj.__module__]``. Code the user wrote in a notebook, or in the script
that calls a ``@distributed`` function, has ``__module__ == "__main__"``; it reaches a rank by
value (cloudpickle), and until it is an attribute of the rank's ``sys.modules["__main__"]``
pickling it there fails with "attribute lookup X on __main__ failed", though the same code works
in the notebook and under torchrun. IPython runs cells in ``sys.modules["__main__"].__dict__``
for this reason; a rank does the same:

- a call's payload runs with a fresh module installed as ``__main__`` (:func:`fresh_main`); a
  ``%%distributed`` cell runs in its ``__dict__``, and a persistent session keeps one such
  module for all its cells;
- a function sent by value brings its globals with it (cloudpickle gives every ``__main__``
  function of one payload one shared globals dict): :func:`adopt` puts the classes and functions
  among them, the by-value functions among the arguments and every class cloudpickle rebuilt from
  ``__main__`` into the rank's ``__main__``, so pickle finds them by name, as the same objects.

The module that started the rank (``python -c``, or the warm starter) is no longer ``__main__``
once a payload runs; nothing of air_magic's looks it up there.
"""

from __future__ import annotations

import builtins
import sys
import types
from typing import Any

import cloudpickle


def fresh_main() -> dict[str, Any]:
    """A new, empty ``__main__`` module in ``sys.modules``; its ``__dict__`` is where code runs."""
    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = module
    return module.__dict__


def rebuilt_so_far() -> set[type]:
    """The ``__main__`` classes cloudpickle has rebuilt in this process until now (see :func:`adopt`)."""
    return set(_rebuilt_main_classes())


def adopt(
    fn: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    namespace: dict[str, Any],
    known: set[type] | frozenset[type] = frozenset(),
) -> None:
    """Make the ``__main__`` classes and functions of a by-value payload attributes of ``namespace``'s module.

    Only classes and functions: they are what pickle looks up by name. Data the function's
    globals carry stays the function's own, so a session's names (a model a cell built) are
    never replaced by the notebook's values; nor is a class or function a session's cell
    defined in ``namespace`` itself. Another one already there is replaced (a later definition
    wins, as in the notebook). ``known``: the classes rebuilt before this payload was loaded
    (:func:`rebuilt_so_far`), which this payload did not bring. air_magic's own functions bring
    nothing.
    """
    for value in (fn, *args, *kwargs.values()):
        if _is_main_function(value):
            for name, obj in value.__globals__.items():
                if not name.startswith("__") and (_is_main_function(obj) or _is_main_class(obj)):
                    _put(namespace, name, obj)
            if _top_level(value):
                _put(namespace, value.__qualname__, value)
    for cls in _rebuilt_main_classes():
        if cls not in known and _top_level(cls):
            _put(namespace, cls.__qualname__, cls)


def _put(namespace: dict[str, Any], name: str, value: Any) -> None:
    current = namespace.get(name)
    if current is value or _defined_in(current, namespace):
        return
    namespace[name] = value


def _defined_in(value: Any, namespace: dict[str, Any]) -> bool:
    """``value`` was defined by code that ran in ``namespace`` (a session's cell), not sent by value."""
    if isinstance(value, types.FunctionType):
        return value.__globals__ is namespace
    if isinstance(value, type):
        return _is_main_class(value) and value not in set(_rebuilt_main_classes())
    return False


def _is_main_function(value: Any) -> bool:
    return isinstance(value, types.FunctionType) and value.__module__ in ("__main__", "__mp_main__")


def _is_main_class(value: Any) -> bool:
    return isinstance(value, type) and value.__module__ in ("__main__", "__mp_main__")


def _top_level(value: Any) -> bool:
    """Defined at a module's top level: pickle looks it up by its qualified name there."""
    return "." not in value.__qualname__ and "<" not in value.__qualname__


def _rebuilt_main_classes() -> list[type]:
    """The classes cloudpickle rebuilt by value in this process whose module was ``__main__``.

    cloudpickle keeps every class it rebuilt in a weak map (so that one class pickled twice is
    rebuilt once): those are the notebook's classes an argument's instance brought along.
    """
    tracker = getattr(cloudpickle.cloudpickle, "_DYNAMIC_CLASS_TRACKER_BY_CLASS", None)
    if tracker is None:  # a cloudpickle without it: the globals above still cover most code
        return []
    return [cls for cls in list(tracker.keys()) if getattr(cls, "__module__", None) == "__main__"]
