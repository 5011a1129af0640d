"""Ray's Jobs API and its dashboard's log files, as a detached run on a Ray cluster uses them.

``calls/ray_jobs.py`` submits a detached run as a Ray job and follows it from
any machine that can reach the cluster's dashboard: everything here is one
HTTP request to it, through Ray's own ``JobSubmissionClient`` (its address
rules, its authentication headers). No ``ray.init``, no local state. Files are
read from the job's node through the dashboard's log API
(``/api/v0/logs/file`` and ``/stream``): what the supervisor writes under the
Ray session's ``logs`` folder there (``air_magic/...``) is readable here.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
from collections.abc import Iterator
from typing import Any

from air_magic.backends.ray import cluster
from air_magic.errors import ConfigurationError, LaunchError

JOBS_HINT = 'pip install "air_magic[ray]" (Ray\'s dashboard and Jobs API come with ray[default])'
REQUEST_TIMEOUT_S = 30.0  # one request to the dashboard (Ray's client sets none)
LOGS_SUBFOLDER = "air_magic"  # under the Ray session's logs folder on the job's node


def client_for(address: str | None) -> Any:
    """Ray's ``JobSubmissionClient`` for the cluster at ``address`` (the dashboard's ``http://``
    address, or ``$RAY_ADDRESS``); a clear error when it cannot be reached."""
    # Ray's client takes $RAY_API_SERVER_ADDRESS, then $RAY_ADDRESS, over the address it is given:
    # an address given here wins (RAY_ADDRESS may be set for ray_init: host:6379, ray://).
    overrides = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")
    used = address or next((os.environ[name] for name in overrides if os.environ.get(name)), None)
    if used and cluster.is_loopback(used):  # before Ray is imported, or it rewrites 127.0.0.1
        cluster.keep_loopback("ray" in sys.modules)
    cluster.require_ray()
    if used and used.startswith("ray://"):
        # Ray would connect as a Ray Client to ask the cluster for its dashboard's address, which is
        # often one only the cluster's own machines reach.
        raise ConfigurationError(
            f"{used}: a Ray Client address cannot submit or follow a detached run; give the cluster's "
            "dashboard address instead (cluster='ray=http://HEAD:8265', --cluster ray=http://HEAD:8265: "
            "what `ray job submit` uses). Calls in the foreground or background take ray:// addresses."
        )
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError as exc:
        raise ImportError(f"a detached run on Ray needs Ray's Jobs API: {JOBS_HINT}") from exc
    try:
        if not address:
            return JobSubmissionClient(None)
        with _environment_without([n for n in overrides if os.environ.get(n, address) != address]):
            return JobSubmissionClient(address)
    except ConnectionError as exc:
        where = address or "$RAY_ADDRESS"
        raise LaunchError(f"could not reach the Ray cluster's dashboard at {where}: {exc}") from None
    except ValueError as exc:  # no address at all, or one Ray cannot read
        raise ConfigurationError(
            f"which Ray cluster? {exc}. Give cluster='ray=http://HEAD:8265' (its dashboard) "
            "or set RAY_ADDRESS"
        ) from None
    except Exception as exc:  # noqa: BLE001 - a GCS address: Ray asks it for the dashboard's (RpcError)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LaunchError(
            f"could not reach the Ray cluster at {used} to submit a detached run ({type(exc).__name__}: "
            f"{first}). Give its dashboard's address (cluster='ray=http://HEAD:8265', "
            "--cluster ray=http://HEAD:8265), what `ray job submit` uses"
        ) from None


_environment_lock = threading.Lock()


@contextlib.contextmanager
def _environment_without(names: list[str]) -> Iterator[None]:
    """``names`` out of the environment while Ray's client reads it (its constructor only; one
    client at a time). Only variables that name another cluster are taken out, so the environment
    is left alone in the usual case (none set, or the same address)."""
    if not names:
        yield
        return
    with _environment_lock:
        saved = {name: os.environ.pop(name) for name in names if name in os.environ}
        try:
            yield
        finally:
            os.environ.update(saved)


def _get(client: Any, endpoint: str, params: dict[str, Any], **kwargs: Any) -> Any:
    """GET from the dashboard with the client's address, headers (its token) and TLS choice. Not
    the client's own ``_do_request``: that reads the whole body first, which a stream never ends."""
    import requests

    return requests.get(
        client._address + endpoint,
        params=params,
        cookies=client._cookies,
        headers=client._headers,
        verify=client._verify,
        **kwargs,
    )


def read_file(client: Any, node_id: str, filename: str) -> bytes | None:
    """The whole file ``filename`` (relative to the logs folder) on node ``node_id``; None when
    it is not there (yet)."""
    params = {"node_id": node_id, "filename": filename, "lines": -1, "media_type": "file"}
    response = _get(client, "/api/v0/logs/file", params, timeout=REQUEST_TIMEOUT_S)
    if response.status_code != 200:
        return None
    data: bytes = response.content  # as written (Ray 2.60 sends a file's bytes unframed)
    return data


def list_files(client: Any, node_id: str, glob: str) -> list[str]:
    """The files on node ``node_id`` whose path under the logs folder matches ``glob``."""
    params = {"node_id": node_id, "glob": glob}
    response = _get(client, "/api/v0/logs", params, timeout=REQUEST_TIMEOUT_S)
    if response.status_code != 200:
        return []
    groups = response.json().get("data", {}).get("result", {})
    return [name for names in groups.values() for name in names]


STREAM_QUIET_S = 60.0  # a stream silent this long is closed (and opened again by a follower that still waits)


def stream_lines(
    client: Any, node_id: str, filename: str, stop: threading.Event, idle_s: float = 0.2
) -> Iterator[str | None]:
    """The lines of ``filename`` on node ``node_id`` from its start, then as they are written (the
    dashboard's log stream); ``None`` each ``idle_s`` without news. Ends when ``stop`` is set, the
    file is not there, or the stream closes (its node or the dashboard went away, or it was
    silent for STREAM_QUIET_S)."""
    params = {"node_id": node_id, "filename": filename, "lines": -1, "media_type": "stream", "interval": 0.1}
    chunks: queue.Queue[bytes | None] = queue.Queue()
    opened: list[Any] = []
    abandoned = threading.Event()

    def read() -> None:  # a thread: the dashboard answers a stream's request only once it has data
        try:
            quiet = (REQUEST_TIMEOUT_S, STREAM_QUIET_S)
            response = _get(client, "/api/v0/logs/stream", params, stream=True, timeout=quiet)
            opened.append(response)
            try:
                if response.status_code == 200 and not abandoned.is_set():
                    for chunk in response.iter_content(chunk_size=None):
                        if abandoned.is_set():  # its reader left before the answer came
                            break
                        chunks.put(chunk)
            finally:
                response.close()
        except Exception:  # noqa: BLE001 - ended below, refused, or silent too long: the stream ends
            pass
        chunks.put(None)

    threading.Thread(target=read, name="air_magic-ray-log-stream", daemon=True).start()
    pending = b""
    try:
        while not stop.is_set():
            try:
                chunk = chunks.get(timeout=idle_s)
            except queue.Empty:
                yield None
                continue
            if chunk is None:
                return
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.decode("utf-8", "replace") + "\n"
    finally:
        abandoned.set()
        for response in opened:
            _wake(response)


def _wake(response: Any) -> None:
    """End the reading thread's wait now: shut its socket down (closing the response from here
    would wait for that thread's read to return, up to STREAM_QUIET_S)."""
    import socket

    sock = getattr(getattr(response.raw, "connection", None), "sock", None)
    try:
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
