"""air_magic: run PyTorch training on every GPU of this machine from a notebook.

Public surface (everything else is private and may change)::

    from air_magic import distributed

    @distributed()
    def train(lr):
        ...

    results = train.distributed(lr=1e-3)   # one value per rank, in rank order

Importing this package is cheap: it imports neither torch, IPython, ipywidgets
nor mlflow, and the caller's side only on first use (rank processes import it too).
"""

from typing import TYPE_CHECKING, Any

from air_magic._version import __version__
from air_magic.errors import (
    AcceleratorError,
    AirMagicError,
    ConfigurationError,
    DirectCallError,
    DistributedTimeoutError,
    LaunchError,
    PayloadError,
    RankFailedError,
    RemoteTraceback,
    SessionEndedError,
)

# The caller's side is imported on first use: a rank imports ``air_magic.worker`` through this
# package, and should not pay for the launcher, the displays and tracking (about 0.1 s).
_LAZY = {
    "AcceleratorType": "air_magic.launch.accelerators",
    "runtime": "air_magic.runtime",  # a module: air_magic.runtime.get_rank()...
    "GPUType": "air_magic.launch.accelerators",
    "DistributedFunction": "air_magic.decorator",
    "distributed": "air_magic.decorator",
    "RunInfo": "air_magic.calls.history",
    "RunHandle": "air_magic.calls.background",
    "runs": "air_magic.calls.anywhere",
    "attach": "air_magic.calls.anywhere",
    "last_run": "air_magic.calls.history",
    "restart_warm_start": "air_magic.calls.call",
    "ray_init": "air_magic.backends.ray.cluster",
    "ray_launch": "air_magic.decorator",
    "init_process_group": "air_magic.worker.torch_helpers",
    "session": "air_magic.calls.persistent",  # air_magic.session(num_accelerators=2): a persistent session
    "Session": "air_magic.calls.persistent",
}

if TYPE_CHECKING:
    from air_magic import runtime
    from air_magic.backends.ray.cluster import ray_init
    from air_magic.calls.anywhere import attach, runs
    from air_magic.calls.background import RunHandle
    from air_magic.calls.call import restart_warm_start
    from air_magic.calls.history import RunInfo, last_run
    from air_magic.calls.persistent import Session, session
    from air_magic.decorator import DistributedFunction, distributed, ray_launch
    from air_magic.launch.accelerators import AcceleratorType, GPUType
    from air_magic.worker.torch_helpers import init_process_group


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'air_magic' has no attribute {name!r}")
    import importlib

    value = importlib.import_module(module)
    if module != f"{__name__}.{name}":  # a name in a module, not the module itself
        value = getattr(value, name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def get_changelog() -> str:
    """What changed in each version of air_magic (CHANGELOG.md), newest first."""
    import os

    # A source checkout has the file beside the package; an installed copy carries it in its
    # metadata's description (pyproject.toml joins README.md and CHANGELOG.md).
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    here = os.path.join(root, "CHANGELOG.md")
    if os.path.exists(os.path.join(root, "pyproject.toml")) and os.path.exists(here):  # our checkout's
        with open(here, encoding="utf-8") as f:
            return f.read()
    from importlib.metadata import PackageNotFoundError, metadata

    try:
        description = metadata("air_magic").get_payload()  # type: ignore[attr-defined]
    except PackageNotFoundError:
        return ""
    text = str(description or "")
    start = text.find("\n# Changelog\n")
    return "" if start < 0 else text[start + 1 :]


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext air_magic``: register ``%%distributed`` and ``%distributed``."""
    from air_magic.calls.call import prestart_local
    from air_magic.notebook.magics import load

    load(ipython)
    prestart_local()  # torch is imported once, in the background, before the first cell needs it


def unload_ipython_extension(ipython: object) -> None:
    """``%unload_ext air_magic``: remove both magics."""
    from air_magic.notebook.magics import unload

    unload(ipython)


__all__ = [
    "AcceleratorError",
    "AcceleratorType",
    "AirMagicError",
    "ConfigurationError",
    "DirectCallError",
    "DistributedFunction",
    "DistributedTimeoutError",
    "GPUType",
    "LaunchError",
    "PayloadError",
    "RankFailedError",
    "RemoteTraceback",
    "RunHandle",
    "RunInfo",
    "Session",
    "SessionEndedError",
    "__version__",
    "attach",
    "distributed",
    "get_changelog",
    "init_process_group",
    "last_run",
    "load_ipython_extension",
    "ray_init",
    "ray_launch",
    "restart_warm_start",
    "runs",
    "runtime",
    "session",
    "unload_ipython_extension",
]
