"""Links to a call's MLflow run, and the one MLflow UI server each local store shares.

Where it sits: ``tracking/run.py`` asks :func:`run_url` for a call's link on the
run's owner thread, once the run exists. With an HTTP tracking URI the link is that
server's page. With a local store (the embedded sqlite one, or a store of the
user's that is not a server) the link goes to a UI server over that store:

- **one per store** for this user, shared by every kernel, script and detached run
  on the machine: ``ui-SPACE.json`` in the store's UI folder names its keeper
  (``ui_server.py``: pid, start, pid namespace) and port, read and written under
  ``ui.lock``, so two kernels never start two servers;
- **started by a call in a Jupyter kernel** (:func:`auto_start_allowed`), never
  waiting for it: the port is chosen first, so the link is known at once and opens
  as soon as MLflow answers (seconds later). Elsewhere (a script, IPython in a
  terminal) an existing server is linked to, and otherwise the text names the
  command that opens the UI (:func:`open_command`);
- **it outlives the kernel**, by design: a restarted kernel, another notebook and
  an old cell's link all reach the same server. Its keeper stops it after a day
  without a call (``ui_server.IDLE_S``), or on ``air-magic ui --stop``.

The address in the link: ``http://127.0.0.1:PORT``; behind JupyterHub with
jupyter-server-proxy installed, the proxy's path (``/user/NAME/proxy/PORT/``);
``AIR_MAGIC_MLFLOW_UI_URL`` (a template with ``{port}``) overrides both.
``AIR_MAGIC_MLFLOW_UI=0`` turns the automatic start off, ``=1`` on everywhere.
Security (docs/security.md): loopback only, umask 077, and no automatic start where
other users' processes are visible (looked at before each start), since loopback is
shared with them; the server answers only the link's own Host names and origins
(:func:`allowed_names`), and gets a minimal environment (``ui_server.minimal_environment``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable

from air_magic import paths, private_files
from air_magic.protocol import env_names
from air_magic.tracking import ui_server

AUTO_ENV = env_names.MLFLOW_UI_AUTO  # 0: never start one on its own; 1: start one even outside a kernel
URL_ENV = env_names.MLFLOW_UI_URL  # the browser's address of the server, "{port}" filled in
_DEFAULT_PORTS = {"http": 80, "https": 443}
PORT_REUSE_WAIT_S = 1.0  # a start is rare (once a day, say): a second for the old port is cheap
STOP_WAIT_S = 20.0  # the keeper gives the server ui_server.GRACE_S, then kills it; this covers both
LOCK_WAIT_S = 5.0  # a call waits this long for the UI folder's lock, then goes on without a link
# A login account, not a system daemon's: the default of /etc/login.defs' UID_MIN on every
# mainstream distribution. nobody (65534) is a daemon's too.
FIRST_LOGIN_UID = 1000
NOBODY_UID = 65534
_keepers: list[subprocess.Popen[bytes]] = []  # keepers this process started


def is_server(uri: str) -> bool:
    """A tracking URI that is itself a server (its own pages); anything else is a store we can serve."""
    return uri.startswith(("http://", "https://", "databricks"))


def absolute(uri: str) -> str:
    """``uri`` with a relative store path made absolute against this process's folder.

    ``sqlite:///mlflow.db`` and ``file:./mlruns`` name files relative to where MLflow runs;
    the server runs elsewhere (its UI folder), and two projects' relative stores are two stores.
    """
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + os.path.abspath(uri[len("sqlite:///") :])
    if uri.startswith("file:") and not uri.startswith("file:/"):
        return "file://" + os.path.abspath(uri[len("file:") :])
    if "://" not in uri and not is_server(uri):
        return os.path.abspath(uri)  # a bare path: MLflow's file store
    return uri


def run_url(uri: str, experiment_id: str, run_id: str) -> str | None:
    """The browser's address of the run: on the tracking server, or on the store's UI server.

    Starts that UI server when none runs and :func:`auto_start_allowed` says so; touches it
    otherwise (a call keeps it from being stopped as idle). None: no server to link to.
    """
    fragment = f"#/experiments/{experiment_id}/runs/{run_id}"
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/{fragment}"
    if is_server(uri):
        return None  # databricks: its workspace's pages, whose host this URI does not name
    # Asked only where no server runs, at each start: other users may have logged in since the last.
    port = server_port(uri, start=auto_start_allowed, wait_s=LOCK_WAIT_S)
    return None if port is None else f"{browser_base(port)}/{fragment}"


def open_command(uri: str, run_id: str) -> str:
    """The command that opens a run of a local store in a browser (named where there is no link)."""
    uri = absolute(uri)
    store = "" if uri == paths.embedded_mlflow_uri() else f" --store '{_without_password(uri)}'"
    return f"{cli_command()} ui{store} --run {run_id}"


def cli_command() -> str:
    """This interpreter's ``air-magic`` as a shell that started this process reaches it.

    Its name where ``PATH`` finds this one; its full path where it is not on ``PATH`` (a fresh
    shell beside a virtual environment that was never activated: ``.venv/bin/air-magic``) or
    another install's comes first; ``PYTHON -m air_magic`` where this interpreter has no script.
    """
    mine = os.path.join(os.path.dirname(sys.executable), "air-magic")
    if not os.access(mine, os.X_OK):
        return f"{shlex.quote(sys.executable)} -m air_magic"
    found = shutil.which("air-magic")
    with contextlib.suppress(OSError):
        if found is not None and os.path.samefile(found, mine):
            return "air-magic"
    return shlex.quote(mine)


def server_port(uri: str, *, start: bool | Callable[[], bool], wait_s: float | None = None) -> int | None:
    """The port of the UI server over ``uri`` (started first when ``start``), touched as in use.

    ``start`` may be a question, asked only when no server runs (that is, before each start).
    ``wait_s``: how long to wait for the folder's lock (:class:`ui_server.LockBusy` after that).
    """
    uri = absolute(uri)
    folder = ui_folder(uri)
    fd = ui_server.locked(folder, wait_s)
    try:
        state = ui_server.state_path(folder)
        record = _live_record(state, uri)
        if record is None and not (start() if callable(start) else start):
            return None
        if record is None:
            record = _start(folder, state, uri)
        os.utime(state)  # in use: not idle
        return int(record["port"])  # type: ignore[call-overload]
    finally:
        os.close(fd)


def ensure_ui(uri: str, timeout_s: float = 90.0) -> str:
    """Start (or find) the UI server over ``uri`` and wait until it answers; its browser address.

    For ``%distributed mlflow-ui`` and ``air-magic ui``, which say "it is up" only once it is.
    ``timeout_s``: ``mlflow server`` takes seconds to answer (it imports MLflow and its
    server app); 90 s leaves room for a loaded machine.
    """
    if is_server(uri):
        return uri.rstrip("/")
    uri = absolute(uri)
    log_path = os.path.join(ui_folder(uri), paths.MLFLOW_UI_LOG)  # made first: the store lock is in it
    _make_tables(uri)
    port = server_port(uri, start=True)
    assert port is not None
    deadline = time.monotonic() + timeout_s
    while not _answers(port):
        if server_port(uri, start=False) != port:
            raise RuntimeError(f"the MLflow UI server over {uri} stopped while starting; see {log_path}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the MLflow UI server did not answer within {timeout_s:g} s; see {log_path}")
        time.sleep(0.2)  # 5 polls a second: ready soon after the server is, at negligible cost
    return browser_base(port)


def stop_ui(uri: str) -> bool:
    """Stop the UI server over ``uri`` (its keeper marks it ended, then stops it); False: none ran.

    Raises RuntimeError if the keeper is still there after :data:`STOP_WAIT_S`.
    """
    uri = absolute(uri)
    folder = ui_folder(uri)
    fd = ui_server.locked(folder)
    try:
        record = _live_record(ui_server.state_path(folder), uri)
    finally:
        os.close(fd)
    if record is None:
        return False
    keeper = str(record["keeper"])  # of this boot and pid namespace (_live_record checked it)
    try:
        os.kill(int(keeper.split("-", 1)[0]), signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + STOP_WAIT_S
    while private_files.owner_alive(keeper):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the MLflow UI server's keeper ({keeper}) did not stop within {STOP_WAIT_S:g} s"
            )
        time.sleep(0.05)
    return True


def browser_base(port: int) -> str:
    """Where a browser finds the server on ``port`` (see the module's docstring)."""
    template = os.environ.get(URL_ENV)
    if template:
        return template.replace("{port}", str(port)).rstrip("/")
    prefix = os.environ.get(env_names.JUPYTERHUB_SERVICE_PREFIX)
    if prefix and importlib.util.find_spec("jupyter_server_proxy") is not None:
        # The hub's user server proxies /user/NAME/proxy/PORT/ to 127.0.0.1:PORT; the browser
        # that shows the notebook reaches that path, never the server's loopback.
        return f"{prefix.rstrip('/')}/proxy/{port}"
    return f"http://127.0.0.1:{port}"


def allowed_names(port: int) -> tuple[list[str], list[str]]:
    """The Host headers and CORS origins the server on ``port`` answers: exactly those its link names.

    Always ``127.0.0.1:PORT`` and ``localhost:PORT`` (MLflow allows loopback origins on its own).
    A link of :data:`URL_ENV` (an SSH tunnel, a port forward, a proxy's public address) adds its
    host and origin; the JupyterHub proxy's path (a link with no host) adds the hub's public host
    where the hub names it (``JUPYTERHUB_PUBLIC_URL``, or ``JUPYTERHUB_HOST`` with subdomains),
    since jupyter-server-proxy passes the browser's Host and Origin on unchanged. Never ``*``.
    """
    hosts = ui_server.loopback_hosts(port)
    origins: list[str] = []
    base = browser_base(port)
    public = [base]
    if "://" not in base:
        public += [
            os.environ.get(env_names.JUPYTERHUB_PUBLIC_URL, ""),
            os.environ.get(env_names.JUPYTERHUB_HOST, ""),
        ]
    for address in public:
        origin = _origin(address)
        if origin is None:
            continue
        host = origin.split("://", 1)[1]
        if host not in hosts:
            hosts.append(host)
        if origin not in origins:
            origins.append(origin)
    return hosts, origins


def _origin(address: str) -> str | None:
    """``scheme://host[:port]`` of an absolute http(s) address, as a browser sends it (None: not one)."""
    try:
        parsed = urllib.parse.urlsplit(address.strip())
        port = parsed.port
    except ValueError:
        return None
    if parsed.scheme not in _DEFAULT_PORTS or not parsed.hostname:
        return None
    host = parsed.hostname.lower()
    if ":" in host:
        host = f"[{host}]"  # IPv6, as in a Host header
    if port is not None and port != _DEFAULT_PORTS[parsed.scheme]:
        host = f"{host}:{port}"
    if any(c in host for c in ",*"):
        return None
    return f"{parsed.scheme}://{host}"


def auto_start_allowed() -> bool:
    """Whether a call may start the store's UI server on its own (see the module's docstring)."""
    chosen = os.environ.get(AUTO_ENV, "").strip().lower()
    if chosen in ("0", "false", "no", "off"):
        return False
    if chosen in ("1", "true", "yes", "on"):
        return True
    return _in_kernel() and not other_users()


def _in_kernel() -> bool:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def other_users() -> tuple[int, ...]:
    """Login accounts other than ours with processes on this machine, as of now (asked before each
    automatic start, never remembered: someone may log in after a kernel's first look).

    They share loopback with us, so a server there would show them our store. Processes of
    others that /proc hides (``hidepid``) are not seen: such a machine counts as ours alone.
    """
    import psutil

    mine = os.getuid()
    found = set()
    for proc in psutil.process_iter(["uids"]):
        uids = proc.info.get("uids")
        if uids is not None and FIRST_LOGIN_UID <= uids.real != NOBODY_UID and uids.real != mine:
            found.add(uids.real)
    return tuple(sorted(found))


def ui_folder(uri: str) -> str:
    """The folder of ``uri``'s UI server: the embedded store's own, else one per store under state."""
    if uri == paths.embedded_mlflow_uri():
        folder = paths.embedded_mlflow_dir()
    else:
        folder = paths.state_dir(paths.MLFLOW_UI_DIR, _key(uri))
    return private_files.private_root(
        folder,
        "the MLflow UI server's folder",
        "Set XDG_STATE_HOME or AIR_MAGIC_MLFLOW_DIR to a folder only you can write",
    )


def _key(uri: str) -> str:
    return hashlib.sha256(uri.encode()).hexdigest()[:16]


def _live_record(state: str, uri: str) -> dict[str, object] | None:
    """The state file's server, if its keeper still runs and it serves ``uri``. Called under ui.lock.

    The state file is this boot's and pid namespace's (``ui_server.state_path``), so the keeper's
    tag is checked for real, never assumed alive as one from elsewhere would be.
    """
    record = ui_server.read_record(state)
    if record is None or record.get("uri_key") != _key(uri) or not isinstance(record.get("port"), int):
        return None
    keeper = record.get("keeper")
    return record if isinstance(keeper, str) and private_files.owner_alive(keeper) else None


def _start(folder: str, state: str, uri: str) -> dict[str, object]:
    """Start a keeper and its server, and record them in the state file. Called under ui.lock."""
    previous = ui_server.read_record(state) or {}
    _stop_leftovers(previous)
    _forget_old_states(folder, state)
    port = _free_port(previous.get("port"))
    # Only what runs Python and MLflow (the server lives up to a day; a kernel's secrets stay there),
    # and the store, not on a command line: it may hold a password.
    env = ui_server.minimal_environment(os.environ)
    env[env_names.MLFLOW_BACKEND_STORE_URI] = uri
    hosts, origins = allowed_names(port)
    command = [sys.executable, "-m", "air_magic.tracking.ui_server", folder, str(port)]
    command += ["--allowed-hosts", ",".join(hosts), "--allowed-origins", ",".join(origins)]
    with open(os.path.join(folder, paths.MLFLOW_UI_LOG), "ab", opener=private_files.opener) as log:
        keeper = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            cwd=folder,
            env=env,
            start_new_session=True,  # not the kernel's: it outlives it, and a Ctrl-C there is not for it
        )
    record: dict[str, object] = {
        "keeper": private_files.process_tag(keeper.pid),
        "port": port,
        "uri_key": _key(uri),
        "started": time.time(),
    }
    ui_server.write_record(state, record)
    # Not waited for: it runs on in its own session. Kept, so that it is reaped (not left a
    # zombie) if it ends while this process lives.
    _keepers[:] = [k for k in _keepers if k.poll() is None] + [keeper]
    return record


def _stop_leftovers(previous: dict[str, object]) -> None:
    """A server whose keeper was killed (no one stops it now): kill its group, to free its port.

    Only when the group's leader is still the very server process recorded (pid, start time and
    pid namespace): a pid reused since by another program is never touched.
    """
    group, server, keeper = previous.get("group"), previous.get("server"), previous.get("keeper")
    if not isinstance(group, int) or not isinstance(server, str) or not isinstance(keeper, str):
        return
    if private_files.owner_alive(keeper) or not private_files.owner_alive(server):
        return  # still looked after, or gone
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)
    import psutil

    members = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) == group:
                members.append(proc)
    psutil.wait_procs(members, timeout=5)  # gone (their port free) before a new server takes it


def _forget_old_states(folder: str, keep: str) -> None:
    """State files of other boots or namespaces untouched for longer than a keeper lives idle: their
    keepers have stopped (a live one is touched by every call, and stops after a day without)."""
    prefix, suffix = paths.MLFLOW_UI_STATE.split("{space}")
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.startswith(prefix) and name.endswith(suffix) and path != keep:
            with contextlib.suppress(OSError):
                if time.time() - os.stat(path).st_mtime > 2 * ui_server.IDLE_S:
                    os.unlink(path)


def _without_password(uri: str) -> str:
    """``uri`` as it may be shown (a cell's output is saved in the notebook): no password."""
    parsed = urllib.parse.urlsplit(uri)
    if parsed.password is None:
        return uri
    host = parsed.hostname or ""
    netloc = f"{parsed.username}:***@{host}" + (f":{parsed.port}" if parsed.port else "")
    return urllib.parse.urlunsplit(parsed._replace(netloc=netloc))


def _free_port(previous: object) -> int:
    """The port the store's last server had, when free (old links work again), else any free one.

    The previous port gets :data:`PORT_REUSE_WAIT_S`: a server that just died may still be
    tearing down its listening socket. The kernel picks the port; mlflow binds it a moment
    later (a small window, on loopback).
    """
    if isinstance(previous, int):
        deadline = time.monotonic() + PORT_REUSE_WAIT_S
        while True:
            if _bindable(previous):
                return previous
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        # As uvicorn binds it: a port whose old connections linger in TIME_WAIT is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _answers(port: int) -> bool:
    try:
        # 2 s: a loopback server that is up answers at once; one that hangs is asked again.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def _make_tables(uri: str) -> None:
    """Open the store once, under its setup lock: the server must not build its tables beside a call."""
    from mlflow.tracking import MlflowClient

    from air_magic.tracking import store

    with store.setup_lock(uri):
        MlflowClient(tracking_uri=uri)
