"""Inside a rank: keep the call's shared MLflow run open and named whatever the rank's code does.

Every rank gets ``MLFLOW_RUN_ID``, so a plain ``mlflow.log_metric`` (or
``with mlflow.start_run():``) in any rank lands in the call's one run. But
MLflow's fluent API ends the active run on ``end_run()`` and at the end of a
``with`` block, which would mark the shared run FINISHED while other ranks
still train. When (and only when) the rank imports ``mlflow``, a post-import
hook patches ``MlflowClient.set_terminated`` to skip the shared run and keep
``MLFLOW_RUN_ID`` set; the launcher ends the run, truthfully, when the call is
over.

The same hook wraps ``mlflow.start_run``. With ``MLFLOW_RUN_ID`` set, MLflow
resumes that run whatever the arguments: ``start_run(run_name=f"rank-{RANK}")``
in every rank would rename the shared run (the last rank wins), and
``set_experiment("x")`` then ``start_run()`` fails with an error about
command-line flags. Code written for ``torchrun`` does both. So a ``start_run``
that asks for a run of its own (a ``run_name``, another experiment or tracking
URI, a ``parent_run_id``, or ``nested=True`` under a run) gets one, as it would
under ``torchrun``, made a child of the shared run (``mlflow.parentRunId``,
when it is in the same store); a plain ``start_run()`` still resumes the shared
run; ``start_run(run_id=<the shared run>, run_name=...)`` resumes it without
renaming it, with a warning. The launcher ends child runs a killed rank left
RUNNING.

The hook also hands ``mlflow.tracking.fluent`` to ``worker/metrics.py``, which
makes per-step metric logging cheap. Importing mlflow costs seconds, so
nothing here imports it.

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

import contextlib
import functools
import importlib.machinery
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

from air_magic.protocol import env_names
from air_magic.worker import metrics as rank_metrics

if TYPE_CHECKING:
    from importlib.abc import Loader


def install() -> None:
    if not os.environ.get(env_names.SHARED_RUN) or any(isinstance(f, _MlflowHook) for f in sys.meta_path):
        return
    for name, patch in _PATCHES.items():
        if name in sys.modules:  # imported before the rank started (a warm starter's preload)
            patch(sys.modules[name])
    sys.meta_path.insert(0, _MlflowHook())


class _MlflowHook:
    """Patches a module of :data:`_PATCHES` right after it is imported (a meta path finder)."""

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
                spec.loader = cast("Loader", _PatchingLoader(spec.loader, patch))
                return spec
        return None


class _PatchingLoader:
    """The module's own loader, then the patch."""

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
    shared = os.environ[env_names.SHARED_RUN]

    def set_terminated(self: Any, run_id: str, status: Any = None, end_time: Any = None) -> None:
        try:
            if run_id != shared:
                original(self, run_id, status, end_time)
        finally:
            # end_run() unsets it whichever run it ends (a rank's child run too): later
            # logging outside a run of the rank's own must still land in the shared run.
            os.environ["MLFLOW_RUN_ID"] = shared

    client_class.set_terminated = set_terminated


def _patch_fluent(fluent: ModuleType) -> None:
    _start_own_runs_as_children(fluent)
    _make_set_experiment_take_effect(fluent)
    rank_metrics.patch_fluent(fluent)


def _make_set_experiment_take_effect(fluent: ModuleType) -> None:
    """Wrap ``set_experiment``: the experiment it returns is the active one, also after a race.

    Every rank runs the same ``mlflow.set_experiment("x")`` at the same moment. When another
    rank creates "x" between MLflow's look-up and its own create, MLflow catches the
    RESOURCE_ALREADY_EXISTS and returns the experiment *without making it active*: that rank's
    next ``start_run()`` lands elsewhere (seen here about once in 30 calls). Made active here.
    """
    original = fluent.set_experiment

    @functools.wraps(original)
    def set_experiment(*args: Any, **kwargs: Any) -> Any:
        experiment = original(*args, **kwargs)
        chosen = _chosen_experiment(fluent)
        if experiment is not None and str(chosen) != str(experiment.experiment_id):
            return original(experiment_id=experiment.experiment_id)
        return experiment

    setattr(fluent, "set_experiment", set_experiment)  # noqa: B010 - a module attribute mypy cannot see
    package = sys.modules.get("mlflow")
    if package is not None and getattr(package, "set_experiment", None) is original:
        setattr(package, "set_experiment", set_experiment)  # noqa: B010 - mlflow was preloaded


def _start_own_runs_as_children(fluent: ModuleType) -> None:
    """Wrap ``start_run``: the shared run when the rank asks for it, else a run of its own under it."""
    from mlflow.tracking import get_tracking_uri

    original = fluent.start_run
    shared = os.environ[env_names.SHARED_RUN]
    shared_uri = os.environ.get("MLFLOW_TRACKING_URI")
    shared_experiment = os.environ.get("MLFLOW_EXPERIMENT_ID")

    @functools.wraps(original)
    def start_run(
        run_id: str | None = None,
        experiment_id: str | None = None,
        run_name: str | None = None,
        nested: bool = False,
        parent_run_id: str | None = None,
        tags: dict[str, Any] | None = None,
        description: str | None = None,
        log_system_metrics: bool | None = None,
        **more: Any,
    ) -> Any:
        given = dict(
            _given(run_id=run_id, experiment_id=experiment_id, run_name=run_name),
            **_given(parent_run_id=parent_run_id, tags=tags, description=description),
            **_given(log_system_metrics=log_system_metrics),
            nested=nested,
            **more,
        )
        if run_id is not None:
            if run_id == shared and run_name is not None:
                given.pop("run_name")
                _warn_not_renamed(run_name)
            return original(**given)
        active = fluent.active_run()
        same_store = not shared_uri or get_tracking_uri() == shared_uri
        experiment = experiment_id if experiment_id is not None else _chosen_experiment(fluent)
        other_experiment = experiment is not None and str(experiment) != shared_experiment
        own = run_name is not None or parent_run_id is not None or not same_store or other_experiment
        if active is None and not own:
            return original(**given)  # resumes the shared run (MLFLOW_RUN_ID)
        if own and active is not None and active.info.run_id == shared:
            given["nested"] = True  # the shared run is air_magic's, not the rank's: nest under it
        elif own and active is None and same_store and parent_run_id is None:
            given["tags"] = {**(tags or {}), "mlflow.parentRunId": shared}
        with _hidden("MLFLOW_RUN_ID"):  # else MLflow would resume the shared run, whatever was asked
            return original(**given)

    setattr(fluent, "start_run", start_run)  # noqa: B010 - a module attribute mypy cannot see
    package = sys.modules.get("mlflow")
    if package is not None and getattr(package, "start_run", None) is original:
        setattr(package, "start_run", start_run)  # noqa: B010 - mlflow was preloaded (a warm starter)


def _chosen_experiment(fluent: ModuleType) -> Any:
    """The rank's ``set_experiment()`` choice: MLflow's private ``_active_experiment_id``.

    Without it (a future MLflow), ``MLFLOW_EXPERIMENT_ID``, which ``set_experiment()`` also
    sets, and which is the shared run's experiment until the rank changes it.
    """
    try:
        return fluent._active_experiment_id
    except AttributeError:
        return os.environ.get("MLFLOW_EXPERIMENT_ID")


def _warn_not_renamed(run_name: str) -> None:
    warnings.warn(
        f"air_magic: run_name={run_name!r} was not applied: the call's MLflow run is shared by every "
        "rank and keeps its name. Name the call with run_name= in @distributed (--run-name), or "
        "leave run_id out to start a child run with this name.",
        UserWarning,
        stacklevel=3,
    )


@contextlib.contextmanager
def _hidden(name: str) -> Iterator[None]:
    """The environment variable ``name`` unset for the block, then as it was."""
    value = os.environ.pop(name, None)
    try:
        yield
    finally:
        if value is not None:
            os.environ[name] = value


def _given(**arguments: Any) -> dict[str, Any]:
    """The arguments the user passed: MLflow 2.x's ``start_run`` takes fewer keywords than 3.x's."""
    return {name: value for name, value in arguments.items() if value is not None}


_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "mlflow.tracking.client": _keep_shared_run_open,
    "mlflow.tracking.fluent": _patch_fluent,
}
