"""The ``[data]`` extra (fsspec, torchdata): imported on first use, with an error that says how to get it."""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL = "pip install 'air_magic[data]'"


def require(module: str) -> ModuleType:
    """``module``, or an ImportError that names the extra (the top package is what is missing)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        if exc.name is not None and exc.name.split(".")[0] != top:
            raise  # the package is there; something it imports is broken: its own error says what
        raise ImportError(f"air_magic.data needs {top} (the [data] extra): {INSTALL}") from exc
