"""The ``@distributed`` decorator: the seed-compatible surface over the call layer.

``@distributed`` / ``@distributed(...)`` wrap a function in a
:class:`DistributedFunction`. ``fn.distributed(*args, **kwargs)`` binds the
arguments against the signature, plans the accelerators, pickles the payload
once (``calls/call.py`` does that and picks the backend), and returns every
rank's return value in rank order or raises the first failing rank's error.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

from air_magic.calls.background import RunHandle
from air_magic.calls.call import prepare_call, run_call, start_async
from air_magic.calls.ray_driver import run_as_driver
from air_magic.errors import ConfigurationError, DirectCallError
from air_magic.launch.accelerators import AcceleratorType
from air_magic.launch.payload import remember_module_file
from air_magic.launch.settings import DEFAULTS, LaunchSettings, make_settings, unset

R = TypeVar("R")
# A keyword left out, shown in help() and editors as the setting's real default.
_LEFT_OUT = {name: unset(default) for name, default in DEFAULTS.items()}


_ANY_ARGUMENTS = inspect.Signature(
    [
        inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
        inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
    ]
)


class DistributedFunction(Generic[R]):
    """A function that runs once per rank through ``.distributed(...)``."""

    def __init__(self, func: Callable[..., R], settings: LaunchSettings):
        if not callable(func):
            raise TypeError(f"@distributed needs a function, got {func!r}")
        self.func = func
        self.settings = settings
        remember_module_file(func)  # so a later edit of its file does not reach the ranks half-way
        try:
            self._signature = inspect.signature(func)
        except (ValueError, TypeError):  # some builtins have none: accept any arguments
            self._signature = _ANY_ARGUMENTS
        functools.update_wrapper(self, func)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        name = getattr(self.func, "__name__", "fn")
        raise DirectCallError(
            f"{name} is decorated with @distributed: call {name}.distributed(...) to run it on every rank, "
            f"or {name}.func(...) to run it once here."
        )

    def __repr__(self) -> str:
        return f"<distributed {getattr(self.func, '__qualname__', self.func)!r} {self.settings!r}>"

    @property
    def num_accelerators(self) -> int | None:
        """The ranks asked for (None: every visible GPU, or 2 CPU ranks without one)."""
        return self.settings.num_accelerators

    @property
    def accelerator_type(self) -> str | None:
        """The accelerator type asked for, as ``GPU_<n>x<MODEL>`` (None: detected at each call).

        A legacy model-only value (``'H100'``) takes its count from ``num_accelerators``; ``N``
        when that is left out too (any count of that model)."""
        spec = self.settings.accelerator_type
        if spec is None:
            return None
        if spec.count is None and self.settings.num_accelerators is not None:
            return f"GPU_{self.settings.num_accelerators}x{spec.model}"
        return spec.name

    def with_overrides(self, **changes: Any) -> DistributedFunction[R]:
        """A new wrapper around the same function with some settings changed."""
        return DistributedFunction(self.func, make_settings(self.settings.raw, **changes))

    def distributed(self, *args: Any, **kwargs: Any) -> list[R]:
        """Run the function on every rank with these arguments; return each rank's result in rank order."""
        bound = self._signature.bind(*args, **kwargs)  # a wrong call fails here, before anything starts
        name = getattr(self.func, "__qualname__", "function")
        return run_call(name, self.func, bound, self.settings).unwrap()

    def distributed_async(self, *args: Any, **kwargs: Any) -> RunHandle:
        """Start the function on every rank and return at once: a :class:`RunHandle` with
        ``result(timeout)`` (each rank's result, or the first failing rank's error), ``done()``,
        ``cancel()``, ``status``, ``logs(rank)`` and ``stacks()``. Every check a foreground call
        makes (arguments, settings, payload, GPUs in use) is made here, before it returns.
        With ``detach=True`` the ranks run under a supervisor that outlives this process.
        """
        bound = self._signature.bind(*args, **kwargs)
        name = getattr(self.func, "__qualname__", "function")
        return start_async(prepare_call(name, self.func, bound, self.settings, background=True))


@overload
def distributed(num_accelerators: Callable[..., R], /) -> DistributedFunction[R]: ...


@overload
def distributed(
    num_accelerators: int | None = None,
    accelerator_type: str | AcceleratorType | None = None,
    timeout: float | None = ...,
    *,
    stop_grace: float | None = None,
    gpus: int | None = None,
    gpu_type: str | None = None,
    run_id: str | None = None,
    display: str = ...,
    env: dict[str, str] | None = None,
    log_dir: str | None = None,
    max_payload_bytes: int = ...,
    tracking: bool = ...,
    experiment: str | None = None,
    run_name: str | None = None,
    warm_start: bool = ...,
    cluster: str | None = None,
    share_gpus: bool = ...,
    detach: bool = ...,
    mlflow_run_id: str | None = None,
    system_metrics: bool = ...,
    remote: bool = False,
) -> Callable[[Callable[..., R]], DistributedFunction[R]]: ...


# The keyword parameters are spelled out (not **settings) so that editors and help() show them;
# tests/unit/test_settings_schema.py checks that they are the schema's fields, and that this
# docstring carries each field's help text.
def distributed(
    num_accelerators: Any = None,
    accelerator_type: Any = None,
    timeout: Any = _LEFT_OUT["timeout"],
    *,
    stop_grace: Any = None,
    gpus: Any = None,
    gpu_type: Any = None,
    run_id: Any = None,  # the former name of mlflow_run_id
    display: Any = _LEFT_OUT["display"],
    env: Any = None,
    log_dir: Any = None,
    max_payload_bytes: Any = _LEFT_OUT["max_payload_bytes"],
    tracking: Any = _LEFT_OUT["tracking"],
    experiment: Any = None,
    run_name: Any = None,
    warm_start: Any = _LEFT_OUT["warm_start"],
    cluster: Any = None,
    share_gpus: Any = _LEFT_OUT["share_gpus"],
    detach: Any = _LEFT_OUT["detach"],
    mlflow_run_id: Any = None,
    system_metrics: Any = _LEFT_OUT["system_metrics"],
    remote: Any = False,
) -> Any:
    """Decorate a training function to run once per GPU (or CPU rank) via ``fn.distributed(...)``.

    ``@distributed`` and ``@distributed()`` both work. Settings (``%%distributed?``
    lists the same ones as options):

    - ``num_accelerators``: ranks to run, one per GPU. Default: every visible GPU;
      2 CPU ranks without a GPU.
    - ``accelerator_type``: the GPUs expected, GPU_<count>x<MODEL> such as GPU_8xH100,
      checked against the machine. Default: detected.
    - ``timeout``: seconds before the call is stopped. Default 10800; ``None``: no limit.
    - ``stop_grace``: seconds the ranks get to end on their own after a stop (the stop button,
      Ctrl-C, a signal to the command line, cancel()) before they are killed: they get SIGINT
      (KeyboardInterrupt), or the signal the command line got, as torchrun forwards it.
      Default: ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30.
    - ``gpus`` / ``gpu_type``: legacy names of the two first (FutureWarning).
    - ``display``: how rank output is shown: auto (live tabs in Jupyter, else text), tabs,
      text (lines prefixed with the rank), rank0 (rank 0's lines only) or none.
      Default ``'auto'``.
    - ``env``: extra environment variables for every rank, a dict of str to str.
    - ``log_dir``: the folder for the call's rank logs. Default: ``$AIR_MAGIC_LOG_DIR``,
      else ``~/.local/state/air_magic/runs``.
    - ``max_payload_bytes``: the most bytes the pickled function and arguments may take.
      Default 512 MiB.
    - ``tracking``: record the call as an MLflow run, when mlflow is installed. Default True.
    - ``warm_start``: fork ranks from a starter process that has imported torch once,
      instead of starting fresh interpreters. Default True.
    - ``cluster``: where the ranks run: this machine, or 'ray' (every node of a Ray
      cluster; 'ray=ADDRESS' names the cluster). Default ``None``: this machine.
    - ``share_gpus``: run even on GPUs that a background run of this process is using
      (both then share their memory and time). Default False.
    - ``detach``: run the ranks under a small supervisor process that outlives this kernel
      (or terminal): air_magic.attach() re-opens the run from any kernel. With cluster='ray'
      the supervisor is a Ray job on the cluster, followed from any machine (docs/ray.md).
      Default False.
    - ``experiment``: the MLflow experiment. Default: MLflow's own, else the notebook's
      or script's name.
    - ``run_name``: the MLflow run's name. Default: MLflow's.
    - ``mlflow_run_id``: an existing MLflow run to record this call in (resume it) instead of a
      new run. Default: a new run (MLFLOW_RUN_ID set here resumes that run). ``run_id`` is its
      former name, still accepted (both given: they must agree).
    - ``system_metrics``: log this machine's CPU, memory, disk, network and GPU use to the run
      under system/ (every MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL seconds, 10 by default).
      Default True.
    - ``remote``: the seed's switch for its pool of remote GPUs. ``False`` (its local mode) is
      what this is; ``True`` is refused with a pointer to ``cluster='ray'`` and ``air-magic run``.
    """
    if callable(num_accelerators) and not isinstance(num_accelerators, AcceleratorType):
        # Bare @distributed: the function came as the first argument.
        return DistributedFunction(num_accelerators, make_settings())
    settings = make_settings(
        num_accelerators=num_accelerators,
        accelerator_type=accelerator_type,
        timeout=timeout,
        stop_grace=stop_grace,
        gpus=gpus,
        gpu_type=gpu_type,
        display=display,
        env=env,
        log_dir=log_dir,
        max_payload_bytes=max_payload_bytes,
        tracking=tracking,
        experiment=experiment,
        run_name=run_name,
        warm_start=warm_start,
        cluster=cluster,
        share_gpus=share_gpus,
        detach=detach,
        mlflow_run_id=mlflow_run_id,
        run_id=run_id,
        system_metrics=system_metrics,
        remote=remote,
    )

    def decorate(func: Callable[..., R]) -> DistributedFunction[R]:
        return DistributedFunction(func, settings)

    return decorate


class RayDriverFunction(DistributedFunction[R]):
    """A function that runs once, as a Ray driver, through ``.distributed(...)`` (see :func:`ray_launch`)."""

    def with_overrides(self, **changes: Any) -> RayDriverFunction[R]:
        return RayDriverFunction(self.func, make_settings(self.settings.raw, **changes))

    def distributed(self, *args: Any, **kwargs: Any) -> list[R]:
        """Run the function once as a driver of the Ray cluster; ``[its result]``."""
        bound = self._signature.bind(*args, **kwargs)
        name = getattr(self.func, "__qualname__", "function")
        return run_as_driver(name, self.func, bound, self.settings).unwrap()

    def distributed_async(self, *args: Any, **kwargs: Any) -> RunHandle:
        raise ConfigurationError(
            "@ray_launch functions run in the foreground only: call fn.distributed(...) "
            "(a Ray driver can itself start Ray work in the background)"
        )


def ray_launch(num_accelerators: Any = None, accelerator_type: Any = None, **settings: Any) -> Any:
    """The seed's ``ray_launch``: ``@ray_launch(...)`` takes the same settings as :func:`distributed`.

    ``fn.distributed(*args)`` checks that the Ray cluster (``ray_init()``'s, or
    ``cluster='ray=ADDRESS'``) has ``num_accelerators`` of ``accelerator_type``,
    then runs ``fn`` once in a fresh process connected to it (``RAY_ADDRESS`` set:
    its ``ray.init()`` joins the cluster), for code that uses Ray Train, Ray Data
    or Tune itself. Returns ``[result]``; errors, tab and MLflow run as for
    ``distributed``.
    """
    if callable(num_accelerators) and not isinstance(num_accelerators, AcceleratorType):
        return RayDriverFunction(num_accelerators, make_settings(cluster="ray"))
    made = make_settings(
        num_accelerators=num_accelerators, accelerator_type=accelerator_type, **{"cluster": "ray", **settings}
    )

    def decorate(func: Callable[..., R]) -> RayDriverFunction[R]:
        return RayDriverFunction(func, made)

    return decorate
