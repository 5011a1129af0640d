"""Connecting to Ray: ``air_magic.ray_init()``, safe by default when it starts a local Ray.

The Ray backend (backend.py) calls :func:`connect` before a call; users call
:func:`ray_init` themselves to choose the cluster (or to pass Ray's own
``ray.init`` arguments). Connecting to an existing cluster (``address=`` or
``RAY_ADDRESS``) takes that cluster as its operators set it up. Starting a
local one, air_magic changes Ray's defaults where they expose this machine
(measured on Ray 2.60, ../shared/NOTES.md "Ray 2.60"):

- every listener on 127.0.0.1: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in the
  environment before the start (``_node_ip_address`` alone is silently replaced
  by the machine's address), and ``_node_ip_address="127.0.0.1"``;
- token authentication with a token file that only this user can read
  (``<state>/ray/auth_token``, 0600; Ray writes its own 0644);
- no usage statistics sent (``RAY_USAGE_STATS_ENABLED=0``);
- no dashboard unless ``include_dashboard=True`` (it is a web server with a job
  submission API);
- ``log_to_driver=False``: Ray's log forwarding merges and deduplicates lines
  across processes (``[repeated 5x across cluster]``); air_magic ships every
  rank's output itself.

Only this module imports ``ray`` at module level in the Ray backend's caller
side; nothing imports it until a call asks for ``cluster="ray"``.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from dataclasses import dataclass
from typing import Any

from air_magic import paths, private_files
from air_magic.errors import ConfigurationError
from air_magic.protocol import env_names

INSTALL_HINT = 'pip install "air_magic[ray]"'
DEFAULT_INIT_TIMEOUT_S = 60.0  # a first local start takes 6-8 s here; a remote head, a second


def require_ray() -> Any:
    """``import ray``, or an ImportError that says how to get it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            f"cluster='ray' needs Ray, which is not installed here: {INSTALL_HINT} "
            "(the same Ray version on every node of the cluster)"
        ) from exc
    return ray


@dataclass(frozen=True)
class ClusterInfo:
    """Where Ray is: its address, whether air_magic started it here, and what it has."""

    address: str
    started_here: bool
    nodes: int
    resources: dict[str, float]
    dashboard_url: str | None = None
    token_path: str | None = None

    def __str__(self) -> str:
        parts = [f"{self.nodes} node{'s' if self.nodes != 1 else ''}"]
        for key in ("GPU", "CPU"):
            if self.resources.get(key):
                parts.append(f"{self.resources[key]:g} {key}")
        how = "started a local Ray (listening on 127.0.0.1 only)" if self.started_here else "connected to Ray"
        text = f"air_magic: {how} at {self.address}: {', '.join(parts)}"
        if self.dashboard_url:
            text += f"; dashboard {self.dashboard_url}"
        return text

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))


CLIENT_START_TRIES = 3  # a ray:// connection whose server the head failed to start (see _init)
_started_here = False
_client_address: str | None = None  # the ray:// address ray_init connected through (Ray Client)


def ray_init(address: str | None = None, **ray_init_kwargs: Any) -> ClusterInfo:
    """Connect to a Ray cluster, or start a local one that is safe by default; say where it is.

    ``address``: a cluster's address (``"auto"``, ``"host:6379"``); default
    ``$RAY_ADDRESS``, else a new local Ray on this machine (127.0.0.1 only,
    token auth with a private token file, no usage statistics, no dashboard
    unless ``include_dashboard=True``). Other keywords go to ``ray.init``.
    Calling it again returns the existing connection.
    """
    global _started_here, _client_address
    imported_before = "ray" in sys.modules
    address = address or os.environ.get(env_names.RAY_ADDRESS) or None
    if address is None and not (imported_before and sys.modules["ray"].is_initialized()):
        # Before `import ray`: Ray reads its authentication settings when it is imported.
        _safe_local_environment()
        if imported_before:
            _reload_ray_config()
    elif address is not None and is_loopback(address):
        keep_loopback(imported_before)
    ray = require_ray()
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"log_to_driver": False, "configure_logging": False}
        if address is None:
            # "local": a new Ray of our own. Without it, ray.init joins whatever cluster
            # /tmp/ray/ray_current_cluster names (any `ray start --head` on this machine).
            kwargs.update(address="local", include_dashboard=False, _node_ip_address="127.0.0.1")
            _started_here, _client_address = True, None
        else:
            kwargs["address"] = address
            _started_here = False
            # Ray Client: the cluster's GCS address (what the runtime context says) is often not
            # reachable from here; this is the address a driver ray_launch starts must use too.
            _client_address = address if address.startswith("ray://") else None
        kwargs.update(ray_init_kwargs)
        _init(ray, kwargs)
    info = cluster_info()
    print(info, file=sys.stderr)
    return info


def is_loopback(address: str) -> bool:
    """``address`` (``host:port``, ``ray://host:port``, ``http://host:port``) names the loopback."""
    host = address.split("://", 1)[-1].rpartition(":")[0] or address.split("://", 1)[-1]
    return host == "localhost" or host.startswith("127.") or host in ("[::1]", "::1")


def keep_loopback(imported_before: bool = True) -> None:
    """A loopback address stays loopback: without ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (read when
    Ray is imported) Ray replaces 127.0.0.1 with the host's address and, against a head that listens
    on loopback only, retries every 5 s without end (../shared/NOTES.md)."""
    if not imported_before:
        # Only for Ray's import: a child of this process (a `ray start` from the notebook) must not
        # inherit it (it refuses to join a multi-node cluster with it).
        saved = os.environ.get(env_names.RAY_LOCAL_ONLY)
        os.environ[env_names.RAY_LOCAL_ONLY] = "0"
        try:
            require_ray()
        except ImportError:
            pass  # said by the caller's require_ray
        finally:
            if saved is None:
                os.environ.pop(env_names.RAY_LOCAL_ONLY, None)
            else:
                os.environ[env_names.RAY_LOCAL_ONLY] = saved
    else:
        try:
            import importlib

            ray_constants = importlib.import_module("ray._private.ray_constants")
            setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)  # noqa: B010 - read when Ray was imported
        except Exception:  # noqa: BLE001 - another Ray version: the bound below still holds
            pass


_pending: Any = None  # a ray.init still running past its bound (a thread cannot be stopped)


def init_timeout() -> float:
    """Seconds a connection may take (``AIR_MAGIC_RAY_INIT_TIMEOUT``, default 60)."""
    text = os.environ.get(env_names.RAY_INIT_TIMEOUT, "")
    try:
        bound = float(text) if text else DEFAULT_INIT_TIMEOUT_S
        if not bound > 0:
            raise ValueError(text)
        return bound
    except ValueError:
        raise ConfigurationError(
            f"{env_names.RAY_INIT_TIMEOUT}={text!r} is not a positive number of seconds (inf: no bound)"
        ) from None


def _init(ray: Any, kwargs: dict[str, Any]) -> None:
    """:func:`_init_once` within :func:`init_timeout`: Ray itself retries a cluster it cannot reach
    without end (every 5 s), so the wait is bounded here, and the error says what was tried."""
    import threading

    if kwargs.get("address") == "local":  # a Ray of our own, started here: nothing to retry
        _init_once(ray, kwargs)
        return
    global _pending
    if _pending is not None and _pending.is_alive():
        raise ConfigurationError(
            "an earlier ray_init is still trying to connect (it ran past its bound); wait for it to "
            "end, or restart the Python process"
        )
    done: list[BaseException | None] = []

    def connect() -> None:
        done.append(_caught(_init_once, ray, kwargs))
        if given_up.is_set() and done[0] is None:  # connected after the caller gave up: not used
            ray.shutdown()

    given_up = threading.Event()
    thread = threading.Thread(target=connect, name="air_magic-ray-init", daemon=True)
    bound = init_timeout()
    _pending = thread
    thread.start()
    try:
        thread.join(None if bound == float("inf") else bound)
    finally:
        given_up.set()
    if not done:
        address = kwargs.get("address")
        raise ConfigurationError(
            f"could not connect to the Ray cluster at {address} within {bound:g} s (ray.init was still "
            "retrying). Check that its head runs and that this machine can reach it; for a head on "
            f"127.0.0.1, {env_names.RAY_LOCAL_ONLY}=0 must be set before Ray is imported (air_magic sets "
            f"it for a loopback address). Set {env_names.RAY_INIT_TIMEOUT} to wait longer."
        )
    if done[0] is not None:
        raise done[0]


def _caught(fn: Any, *args: Any) -> BaseException | None:
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
        return exc
    return None


def _init_once(ray: Any, kwargs: dict[str, Any]) -> None:
    """``ray.init``; for a Ray Client address, tried again when the head's client server fails to
    start the server of this connection: Ray's proxier forks it from a process with gRPC threads,
    and on a busy head it sometimes dies at once with empty logs (seen in 2 of 6 loopback runs
    here; ray-project/ray#18876, #28091). Ray disconnects the failed attempt itself."""
    client = str(kwargs.get("address", "")).startswith("ray://")
    for attempt in range(1, CLIENT_START_TRIES + 1):
        try:
            ray.init(**kwargs)
            return
        except ConnectionAbortedError as exc:
            # Ray says it two ways: the server died before the proxier looked ("client server
            # failed"), or while it looked (a ZombieProcess in start_specific_server).
            said = str(exc)
            flake = "client server failed" in said or "start_specific_server" in said
            if not client or not flake or attempt == CLIENT_START_TRIES:
                raise
            print(
                f"air_magic: the Ray Client server at {kwargs['address']} failed to start this "
                f"connection's server (attempt {attempt} of {CLIENT_START_TRIES}); trying again",
                file=sys.stderr,
            )
            time.sleep(1.0)


def check_address(address: str) -> None:
    """Refuse a call for cluster ``address`` while this process is connected to another one."""
    current = connected_address()
    if _host_port(address) not in (_host_port(current), "auto"):
        raise ConfigurationError(
            f"cluster='ray={address}' was asked for, but this process is connected to the Ray cluster at "
            f"{current} (one cluster per process, Ray's rule). ray.shutdown() first, or leave the "
            "address out."
        )


def connected_address() -> str:
    """The address of the cluster this process is connected to, as a new driver must be given it:
    the ``ray://`` one for a Ray Client connection of :func:`ray_init`, else the GCS's."""
    ray = require_ray()
    if _client_address is not None and ray.is_initialized():
        return _client_address
    return getattr(ray.get_runtime_context(), "gcs_address", None) or ""


def _host_port(address: str) -> str:
    host, _, port = address.rpartition(":")
    return f"{'127.0.0.1' if host in ('localhost', '') else host}:{port}" if port.isdigit() else address


def connect() -> Any:
    """The ``ray`` module, connected: the current connection, or :func:`ray_init`'s default one."""
    ray = require_ray()
    if not ray.is_initialized():
        ray_init()
    return ray


def cluster_info() -> ClusterInfo:
    ray = require_ray()
    gcs = connected_address()
    alive = [n for n in ray.nodes() if n.get("Alive")]
    dashboard = getattr(getattr(ray, "_private", None), "worker", None)
    url = None
    try:
        url = dashboard.get_dashboard_url() if dashboard is not None else None
    except Exception:  # noqa: BLE001 - no dashboard
        url = None
    token = os.environ.get(env_names.RAY_AUTH_TOKEN_PATH)
    return ClusterInfo(
        address=gcs,
        started_here=_started_here,
        nodes=len(alive),
        resources=dict(ray.cluster_resources()),
        dashboard_url=f"http://{url}" if url and not url.startswith("http") else (url or None),
        token_path=token if _started_here else None,
    )


def _safe_local_environment() -> None:
    """Ray reads these when it starts its processes (which inherit them): set them first."""
    os.environ[env_names.RAY_LOCAL_ONLY] = "0"
    os.environ.setdefault(env_names.RAY_USAGE_STATS, "0")
    if os.environ.get(env_names.RAY_AUTH_MODE, "token") == "token":
        os.environ[env_names.RAY_AUTH_MODE] = "token"
        os.environ.setdefault(env_names.RAY_AUTH_TOKEN_PATH, _private_token())


def _reload_ray_config() -> None:
    """Ray was imported before the variables above were set: make it read them again.

    Ray's own test helpers do exactly this (``ray._private.authentication_test_utils``);
    without it the driver would run without the token its cluster demands.
    """
    try:
        import importlib

        ray_constants = importlib.import_module("ray._private.ray_constants")
        raylet = importlib.import_module("ray._raylet")
        setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)  # noqa: B010 - read when Ray was imported: loopback addresses
        raylet.Config.initialize("")
        raylet.AuthenticationTokenLoader.instance().reset_cache()
    except Exception:  # noqa: BLE001 - another Ray version: ray.init says what is wrong
        pass


def _private_token() -> str:
    """This user's token file for local Rays (0600 in a 0700 folder), made once."""
    folder = paths.state_dir(paths.RAY_DIR)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    private_files.private_root(folder, "the Ray state folder", "Remove it; air_magic makes it again")
    path = os.path.join(folder, paths.RAY_TOKEN)
    fd = private_files.open_private(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size == 0:
            os.write(fd, secrets.token_hex(32).encode())
    finally:
        os.close(fd)
    return path
