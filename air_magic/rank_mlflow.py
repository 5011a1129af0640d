"""Inside a rank: keep the call's shared MLflow run open whatever the rank's code does.

Every rank gets ``MLFLOW_RUN_ID``, so a plain ``mlflow.log_metric`` (or
``with mlflow.start_run():``) in any rank lands in the call's one run. But
MLflow's fluent API ends the active run on ``end_run()`` and at the end of a
``with`` block, which would mark the shared run FINISHED while other ranks
still train. When (and only when) the rank imports ``mlflow``, a post-import
hook patches ``MlflowClient.set_terminated`` to skip the shared run and keep
``MLFLOW_RUN_ID`` set; the launcher ends the run, truthfully, when the call is
over. The same hook hands ``mlflow.tracking.fluent`` to ``rank_metrics``, which
makes per-step metric logging cheap. Importing mlflow costs seconds, so
nothing here imports it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from air_magic import rank_metrics
from air_magic.rank_metrics import ENV_SHARED


def install() -> None:
    if not os.environ.get(ENV_SHARED) or any(isinstance(f, _MlflowHook) for f in sys.meta_path):
        return
    for name, patch in _PATCHES.items():
        if name in sys.modules:  # imported before the rank started (a warm starter's preload)
            patch(sys.modules[name])
    sys.meta_path.insert(0, _MlflowHook())


class _MlflowHook(importlib.abc.MetaPathFinder):
    """Patches a module of :data:`_PATCHES` right after it is imported."""

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patch: Callable[[ModuleType], None]):
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)


def _keep_shared_run_open(module: ModuleType) -> None:
    client_class = module.MlflowClient
    original = client_class.set_terminated
    shared = os.environ[ENV_SHARED]

    def set_terminated(self: Any, run_id: str, status: Any = None, end_time: Any = None) -> None:
        if run_id == shared:
            os.environ["MLFLOW_RUN_ID"] = shared  # end_run() unset it; later logging must still land here
            return
        original(self, run_id, status, end_time)

    client_class.set_terminated = set_terminated


_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "mlflow.tracking.client": _keep_shared_run_open,
    "mlflow.tracking.fluent": rank_metrics.patch_fluent,
}
