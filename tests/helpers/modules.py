"""Optional packages a test module needs, checked without importing them.

``pytest.importorskip`` at a module's top imports the package while pytest collects, in every
pytest process (each xdist worker, the serial part): jupyterlab, nbclient and nbformat cost
about 5 s of CPU there, for tests most of those processes never run. ``skip_unless_installed``
only looks the packages up; ``lazy`` imports a module on first use.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any

import pytest


def skip_unless_installed(*names: str) -> pytest.MarkDecorator:
    """A mark that skips the tests when one of ``names`` cannot be imported (found, not imported)."""
    missing = [name for name in names if _find(name) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (not installed)")


def _find(name: str) -> Any:
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a dotted name whose parent is missing
        return None


class lazy:
    """A module imported on first attribute access: ``nbformat = lazy("nbformat")``."""

    def __init__(self, name: str):
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):  # pytest's look for fixtures (``__wrapped__``...): not a use
            raise AttributeError(attr)
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)
