"""Inside a rank: patch a third-party module right after it is imported (a meta path finder).

The rank's own hooks register here before the user's code runs: ``worker/mlflow_hook.py``
(MLflow's run handling, Lightning's MLflow logger) and ``worker/frameworks.py``
(Lightning's launchers, Accelerate's state per cell). A module that is already imported (a warm starter's
preload) is patched at once; any other when, and only when, the rank imports it: nothing here
imports a framework.

**Why a finder of our own, not wrapt's post-import hooks.** Tried:
``wrapt.register_post_import_hook`` does the same job (it too patches after the
module's ``exec_module``, before ``mlflow/__init__`` binds ``start_run`` and
``log_metric``, and calls the hook at once for a module already imported), and
passed both cases (mlflow preloaded by a warm starter, and imported later by
the rank). Not used for its cost: the hook must be in place before the rank's
code runs, so ``import wrapt`` cannot wait for mlflow's import, and wrapt 2.5
imports its whole package (asyncio and importlib.metadata among it): 56-60 ms
in a fresh interpreter, +33 ms on top of ``air_magic.worker.entry``, which
itself takes 30-46 ms (wrapt 1.17: 9 ms, +2 ms; ``python -X importtime``, min
and median of 15 runs, the 2-core CPU machine). Every cold rank and every warm
starter would pay it, and every install would need one more dependency, to
replace the 30 lines below. Also, wrapt 2 fires a module's hooks once per
process and then forgets them; this finder patches a module each time it is
executed. The finder and its loader are duck-typed: subclassing ``importlib.abc``
would cost a rank about 7 ms of imports (importlib.resources, tempfile, shutil).
"""

from __future__ import annotations

import importlib.machinery
import sys
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from importlib.abc import Loader

Patch = Callable[[ModuleType], None]

_PATCHES: dict[str, list[Patch]] = {}


def register(patches: Mapping[str, Patch]) -> None:
    """Apply each patch to its module now if it is imported, else when it is; once per patch."""
    for name, patch in patches.items():
        registered = _PATCHES.setdefault(name, [])
        if patch in registered:
            continue
        registered.append(patch)
        if name in sys.modules:  # imported before the rank started (a warm starter's preload)
            _apply(patch, sys.modules[name])
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())


class _PostImportFinder:
    """Finds a registered module with the other finders, and wraps its loader."""

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        patches = _PATCHES.get(fullname)
        if not patches:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = cast("Loader", _PatchingLoader(spec.loader, patches))
                return spec
        return None


class _PatchingLoader:
    """The module's own loader, then the patches."""

    def __init__(self, loader: Any, patches: list[Patch]):
        self._loader = loader
        self._patches = patches

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for patch in self._patches:
            _apply(patch, module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, resource readers...
        return getattr(self._loader, name)


def _apply(patch: Patch, module: ModuleType) -> None:
    """A patch that fails (another version of the package) leaves the module as it was, said once."""
    try:
        patch(module)
    except Exception as exc:  # noqa: BLE001 - the user's import must still work
        warnings.warn(
            f"air_magic could not adapt {module.__name__} ({type(exc).__name__}: {exc}); "
            "it runs as its package made it",
            RuntimeWarning,
            stacklevel=2,
        )
