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

Runs made through ``MlflowClient.create_run`` in a rank (Lightning's
``MLFlowLogger``, user code with a client of its own) are children of the
shared run too, so nothing a rank starts is a separate top-level run. And a
Lightning ``MLFlowLogger()`` made as Lightning's docs show it (no
experiment, run name or run id of its own) is a plain ``start_run()`` in
Lightning's words: it logs into the call's run, as transformers' ``Trainer``
and Accelerate's tracker do through ``MLFLOW_RUN_ID`` (docs/torchrun.md,
"Frameworks' MLflow logging").

The patches are applied by ``worker/post_import.py`` as the modules are
imported.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from air_magic.protocol import env_names
from air_magic.worker import metrics as rank_metrics
from air_magic.worker import post_import


def install() -> None:
    """Register the patches when the call has a shared run (tracking on)."""
    if os.environ.get(env_names.SHARED_RUN):
        post_import.register(_PATCHES)


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
    _make_created_runs_children(client_class)


def _make_created_runs_children(client_class: Any) -> None:
    """Wrap ``create_run``: a run a rank makes in the call's store is a child of the shared run.

    Fluent ``start_run`` makes its runs through it too (when it does not resume one); a run
    that already names a parent (``nested=True``, ``parent_run_id=``) keeps it.
    """
    original = client_class.create_run
    shared = os.environ[env_names.SHARED_RUN]
    shared_uri = os.environ.get("MLFLOW_TRACKING_URI")

    @functools.wraps(original)
    def create_run(
        self: Any,
        experiment_id: str,
        start_time: int | None = None,
        tags: dict[str, Any] | None = None,
        run_name: str | None = None,
    ) -> Any:
        if (not shared_uri or self.tracking_uri == shared_uri) and "mlflow.parentRunId" not in (tags or {}):
            tags = {**(tags or {}), "mlflow.parentRunId": shared}
        return original(self, experiment_id, start_time, tags, run_name)

    client_class.create_run = create_run


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
        # (With no run active, create_run makes the new run a child of the shared one.)
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


def _lightning_logger_joins_shared_run(module: ModuleType) -> None:
    """Wrap ``MLFlowLogger.__init__``: a plain logger logs into the call's run.

    Plain: no ``experiment_name``, ``run_name`` or ``run_id``, and the call's store (or none
    given). Lightning would make a new run in experiment "lightning_logs"; given the shared
    run's id, it logs there and its ``finalize`` leaves the run to the launcher. A logger that
    asks for a run of its own gets one, a child of the shared run (``create_run`` above). The
    call's store is passed explicitly: Lightning reads ``MLFLOW_TRACKING_URI`` as a default
    argument, when it is imported, which a warm starter's preload does before the call.
    """
    logger_class = module.MLFlowLogger
    original = logger_class.__init__
    shared = os.environ[env_names.SHARED_RUN]
    shared_uri = os.environ.get("MLFLOW_TRACKING_URI")

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        own = args or any(kwargs.get(name) is not None for name in ("experiment_name", "run_name", "run_id"))
        if kwargs.get("tracking_uri") is None and len(args) < 3 and shared_uri:
            kwargs["tracking_uri"] = shared_uri  # what importing Lightning in the rank would have read
        if not own and kwargs.get("tracking_uri") in (None, shared_uri):
            kwargs["run_id"] = shared
        original(self, *args, **kwargs)

    logger_class.__init__ = __init__


# Lightning ships the same logger in the ``lightning`` package and the older ``pytorch_lightning``.
_PATCHES: dict[str, post_import.Patch] = {
    "mlflow.tracking.client": _keep_shared_run_open,
    "mlflow.tracking.fluent": _patch_fluent,
    "lightning.pytorch.loggers.mlflow": _lightning_logger_joins_shared_run,
    "pytorch_lightning.loggers.mlflow": _lightning_logger_joins_shared_run,
}
