"""The public surface is a contract: exactly these names, each importable, and a cheap import."""

from __future__ import annotations

import air_magic

PUBLIC = [
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


def test_all_is_exactly_the_public_names():
    assert air_magic.__all__ == PUBLIC  # a name added or removed is a decision: change this list too


def test_every_public_name_is_there():
    missing = [name for name in PUBLIC if not hasattr(air_magic, name)]
    assert not missing


def test_star_import_gives_exactly_the_public_names():
    namespace: dict[str, object] = {}
    exec("from air_magic import *", namespace)
    assert sorted(set(namespace) - {"__builtins__"}) == sorted(PUBLIC)
    for name in PUBLIC:
        assert namespace[name] is getattr(air_magic, name)
