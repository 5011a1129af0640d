"""The store's shared MLflow UI server (issue 19, item 3; tracking/ui.py, tracking/ui_server.py).

Real kernels, a real ``mlflow server``, real processes killed: a call in a notebook
starts one server per store without waiting for it, its link opens the run, a second
kernel and a restarted one reuse it, it outlives them, and it stops when asked, when
idle, or goes cleanly when killed. Outside a kernel nothing is started and the text
names the command that opens the run.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import psutil
import pytest
from helpers.modules import skip_unless_installed

from air_magic import paths, private_files
from air_magic.tracking import ui as mlflow_ui
from air_magic.tracking import ui_server

pytestmark = skip_unless_installed("mlflow")
fault = pytest.mark.fault

CALL = (
    "import air_magic\n"
    "@air_magic.distributed(num_accelerators=2, display='text', run_name='{name}')\n"
    "def f():\n"
    "    return 1\n"
    "f.distributed()\n"
    "print('LINK', air_magic.last_run().tracking_url)\n"
)
UP_WAIT_S = 120.0  # mlflow server's start: seconds, more on a loaded 2-core machine


@pytest.fixture
def store(tmp_path, monkeypatch, new_store):
    """A fresh embedded store for the test, the automatic start as a user gets it (no opt-out)."""
    monkeypatch.setenv("AIR_MAGIC_MLFLOW_DIR", new_store(tmp_path / "mlflow"))
    monkeypatch.delenv(mlflow_ui.AUTO_ENV, raising=False)
    uri = paths.embedded_mlflow_uri()
    yield uri
    mlflow_ui.stop_ui(uri)


def _record() -> dict:
    with open(ui_server.state_path(paths.embedded_mlflow_dir())) as f:
        return json.load(f)


def _keepers_of(folder: str) -> list[psutil.Process]:
    """The keeper processes serving ``folder`` (a keeper's fork before it execs the server is not one)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "ppid"]):
        cmdline = proc.info["cmdline"] or []
        if "air_magic.tracking.ui_server" in cmdline and folder in cmdline:
            found.append(proc)
    pids = {p.pid for p in found}
    return [p for p in found if p.info["ppid"] not in pids]


def _link(printed: str) -> str:
    found = re.search(r"^LINK (\S+)$", printed, re.M)
    assert found, printed
    return found[1]


def _run_json(link: str, timeout_s: float = UP_WAIT_S) -> dict:
    """The run behind a link, as the UI's own page asks the server for it (waits for the server)."""
    base, run_id = link.split("/#/")[0], link.rsplit("/", 1)[1]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(
                f"{base}/ajax-api/2.0/mlflow/runs/get?run_id={run_id}", timeout=5
            ) as r:
                return json.load(r)["run"]
        except OSError:
            assert time.monotonic() < deadline, f"{base} did not answer within {timeout_s} s"
            time.sleep(0.5)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _kernel_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != mlflow_ui.AUTO_ENV}
    env.update(extra)
    return env


def test_a_notebook_call_starts_one_shared_ui_whose_link_opens_the_run_and_outlives_the_kernel(
    store, tmp_path
):
    from helpers.kernel import Kernel

    with Kernel(cwd=tmp_path, env=_kernel_env()) as kernel:
        started = time.monotonic()
        first = _link(kernel.printed(CALL.format(name="first-call")))
        took = time.monotonic() - started
        # The restarted kernel (same notebook) links to the same server.
        kernel.restart_in_background()
        kernel.wait_restarted()
        again = _link(kernel.printed(CALL.format(name="after-restart")))
    assert re.match(r"http://127\.0\.0\.1:\d+/#/experiments/\d+/runs/[0-9a-f]{32}$", first), first
    port = int(first.split(":")[2].split("/")[0])
    assert again.split("/#/")[0] == first.split("/#/")[0]
    keeper = _record()["keeper"]
    # Every kernel is gone: the server is not (the old links keep working), and it serves both runs.
    assert _run_json(first)["info"]["run_name"] == "first-call"
    assert _run_json(again)["info"]["status"] == "FINISHED"
    with urllib.request.urlopen(first.split("#")[0], timeout=10) as page:
        assert b"<title>MLflow</title>" in page.read()
    # Another kernel, another notebook: the same server, not a second one.
    with Kernel(cwd=tmp_path, env=_kernel_env()) as other:
        third = _link(other.printed(CALL.format(name="other-kernel")))
    assert third.split("/#/")[0] == first.split("/#/")[0] and _record()["keeper"] == keeper
    assert len(_keepers_of(paths.embedded_mlflow_dir())) == 1
    # Stopped on request: the port closes, ui.json goes, no process of it stays.
    assert mlflow_ui.stop_ui(store)
    assert not _port_open(port)
    assert "keeper" not in _record() and not private_files.owner_alive(keeper)
    print(f"first call with the UI starting beside it: {took:.1f} s")


def test_opted_out_or_outside_a_kernel_nothing_starts_and_the_text_names_the_command(store, tmp_path):
    from helpers.kernel import Kernel

    # A fresh shell beside the virtual environment, never activated: its air-magic is not on PATH,
    # so the text names the full path (issue 48, item 19); where PATH finds it, its name.
    venv_bin = os.path.dirname(sys.executable)
    script_path = os.path.join(venv_bin, "air-magic")
    assert os.access(script_path, os.X_OK), "the install's air-magic script beside this interpreter"
    folders = os.environ.get("PATH", "").split(os.pathsep)
    on_path = [p for p in folders if p and os.path.abspath(p) != venv_bin]
    fresh_shell = os.pathsep.join(on_path) or "/usr/bin:/bin"
    activated = os.pathsep.join([venv_bin, fresh_shell])
    with Kernel(cwd=tmp_path, env=_kernel_env(**{mlflow_ui.AUTO_ENV: "0", "PATH": fresh_shell})) as kernel:
        printed = kernel.printed(CALL.format(name="opted-out"))
    assert _link(printed) == "None"
    run_id = re.search(r"MLflow run ([0-9a-f]{32})", printed)[1]
    named = re.search(r"\(to open it: (.+)\)", printed)[1]
    assert named == f"{shlex.quote(script_path)} ui --run {run_id}"
    # A script: no kernel, so no server either; the same words, the bare name where PATH finds it.
    script = subprocess.run(
        [sys.executable, "-c", CALL.format(name="from-a-script")],
        env=_kernel_env(PATH=activated),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert script.returncode == 0, script.stderr
    assert _link(script.stdout) == "None" and "(to open it: air-magic ui --run " in script.stderr
    assert not os.path.exists(ui_server.state_path(paths.embedded_mlflow_dir()))
    # The command it names opens that run, typed in that fresh shell.
    shown = subprocess.run(
        shlex.split(named),
        env=_kernel_env(PATH=fresh_shell),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert shown.returncode == 0, shown.stderr
    link = shown.stdout.strip()
    assert _run_json(link, timeout_s=10)["info"]["run_name"] == "opted-out"  # up before it printed
    stopped = subprocess.run(
        [sys.executable, "-m", "air_magic", "ui", "--stop"], env=_kernel_env(), capture_output=True, text=True
    )
    assert "stopped" in stopped.stdout
    assert not _port_open(int(link.split(":")[2].split("/")[0]))


def test_callers_starting_at_once_share_one_lean_server(store):
    starter = (
        "import sys, time\n"
        "from air_magic.tracking import ui\n"
        "time.sleep(max(0.0, float(sys.argv[1]) - time.time()))\n"  # all at the same moment
        f"print(ui.server_port({store!r}, start=True))\n"
    )
    at = str(time.time() + 2.0)
    procs = [
        subprocess.Popen([sys.executable, "-c", starter, at], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    ports = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert len(ports) == 1, ports
    deadline = time.monotonic() + UP_WAIT_S
    port = int(next(iter(ports)))
    while not mlflow_ui._answers(port):  # up: the keeper has forked and exec'd its server
        assert time.monotonic() < deadline
        time.sleep(0.2)
    keepers = _keepers_of(paths.embedded_mlflow_dir())
    assert len(keepers) == 1
    # Lean (docs/benchmarks.md): the keeper, `mlflow server` and its one web worker; MLflow's job
    # runner (a huey consumer pool, 8 more processes and ~1.5 GB) is off. Given time to start it.
    time.sleep(3)
    tree = [keepers[0], *keepers[0].children(recursive=True)]
    assert len(tree) <= 3, [" ".join(p.cmdline()[:4]) for p in tree]


def _server_up(uri: str) -> tuple[int, dict]:
    port = mlflow_ui.server_port(uri, start=True)
    assert port is not None
    deadline = time.monotonic() + UP_WAIT_S
    while not mlflow_ui._answers(port):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    return port, _record()


@fault(
    "the shared MLflow UI server, or its keeper, is killed with SIGKILL",
    "nothing of it stays running; the next call starts a new one on the same port, so old links open",
)
def test_a_killed_server_or_keeper_leaves_nothing_behind_and_the_next_call_starts_a_new_one(store):
    # 1. The server dies (OOM killer, a crash): its keeper forgets it at once.
    port, record = _server_up(store)
    keeper = psutil.Process(int(record["keeper"].split("-")[0]))
    os.killpg(record["group"], signal.SIGKILL)
    keeper.wait(timeout=30)
    assert _record()["ended"].startswith("the server exited with status")
    # 2. The next caller starts a new one, on the same port (old links work again).
    port2, record2 = _server_up(store)
    assert port2 == port and record2["keeper"] != record["keeper"]
    # 3. The keeper is killed (SIGKILL: it cannot stop its server): the next caller stops what it left.
    os.kill(int(record2["keeper"].split("-")[0]), signal.SIGKILL)
    group = record2["group"]
    time.sleep(0.5)
    assert any(_in_group(p, group) for p in psutil.process_iter())  # left running, holding the port
    port3, _ = _server_up(store)
    assert port3 == port  # the leftover was stopped, freeing its port
    assert not any(_in_group(p, group) for p in psutil.process_iter())


def _in_group(proc: psutil.Process, group: int) -> bool:
    try:
        return os.getpgid(proc.pid) == group and proc.status() != psutil.STATUS_ZOMBIE
    except (OSError, psutil.Error):
        return False


def test_the_keeper_stops_an_idle_server_and_one_ui_json_no_longer_names(tmp_path):
    folder = str(tmp_path / "ui")
    os.mkdir(folder, 0o700)
    uri = f"sqlite:///{tmp_path / 'store.db'}"

    state = ui_server.state_path(folder)

    def keeper(port: int) -> tuple[subprocess.Popen, str]:
        fd = ui_server.locked(folder)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "air_magic.tracking.ui_server", folder, str(port),
                 "--idle-s", "3", "--check-s", "0.5"],
                env=dict(os.environ, MLFLOW_BACKEND_STORE_URI=uri),
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            tag = private_files.process_tag(proc.pid)
            ui_server.write_record(
                state, {"keeper": tag, "port": port, "uri_key": "k", "started": time.time()}
            )
        finally:
            os.close(fd)
        return proc, tag

    # Idle: nobody touched the state file for --idle-s.
    proc, _ = keeper(mlflow_ui._free_port(None))
    started = time.monotonic()
    assert proc.wait(timeout=60) == 0
    assert time.monotonic() - started >= 3
    assert ui_server.read_record(state)["ended"].startswith("no call for")
    assert "ended: no call for" in proc.stderr.read()
    # Replaced: the state file names another keeper.
    proc, _ = keeper(mlflow_ui._free_port(None))
    fd = ui_server.locked(folder)
    ui_server.write_record(state, {"keeper": "1-1-other", "port": 1, "uri_key": "k", "started": time.time()})
    os.close(fd)
    assert proc.wait(timeout=30) == 0
    assert ui_server.read_record(state)["keeper"] == "1-1-other"  # not its to change
    assert "ended: the state file names another server" in proc.stderr.read()


def test_the_links_address_follows_jupyterhub_and_the_users_template(monkeypatch):
    pytest.importorskip("jupyter_server_proxy")
    monkeypatch.delenv(mlflow_ui.URL_ENV, raising=False)
    monkeypatch.delenv("JUPYTERHUB_SERVICE_PREFIX", raising=False)
    assert mlflow_ui.browser_base(5123) == "http://127.0.0.1:5123"
    monkeypatch.setenv("JUPYTERHUB_SERVICE_PREFIX", "/user/ada/")
    assert mlflow_ui.browser_base(5123) == "/user/ada/proxy/5123"
    monkeypatch.setenv(mlflow_ui.URL_ENV, "https://hub.example/user/ada/proxy/{port}/")
    assert mlflow_ui.browser_base(5123) == "https://hub.example/user/ada/proxy/5123"


def test_the_servers_job_runner_is_off_unless_the_user_turned_it_on():
    assert ui_server.server_environment({"PATH": "/bin"}) == {
        "PATH": "/bin",
        ui_server.JOB_EXECUTION_ENV: "false",
    }
    wanted = {ui_server.JOB_EXECUTION_ENV: "true"}
    assert ui_server.server_environment(wanted) == wanted


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a process as another user needs root")
def test_no_automatic_start_where_another_users_processes_run(monkeypatch):
    monkeypatch.delenv(mlflow_ui.AUTO_ENV, raising=False)
    other = subprocess.Popen(["sleep", "60"], user=4321, group=4321)
    try:
        assert 4321 in mlflow_ui.other_users()
        # In a kernel this is what decides; outside one the answer is no anyway.
        monkeypatch.setattr(mlflow_ui, "_in_kernel", lambda: True)
        assert not mlflow_ui.auto_start_allowed()
        monkeypatch.setenv(mlflow_ui.AUTO_ENV, "1")
        assert mlflow_ui.auto_start_allowed()  # asked for: started anyway
    finally:
        other.kill()
        other.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a process as another user needs root")
def test_other_users_are_looked_for_again_before_each_start(monkeypatch, store, tmp_path):
    """A kernel that first looked while alone must not go on starting the UI once others log in
    (issue 48, item 14): the look is made at each start, never remembered."""
    monkeypatch.delenv(mlflow_ui.AUTO_ENV, raising=False)
    monkeypatch.setattr(mlflow_ui, "_in_kernel", lambda: True)
    assert 4322 not in mlflow_ui.other_users()
    assert mlflow_ui.auto_start_allowed()  # alone: a call would start it
    other = subprocess.Popen(["sleep", "60"], user=4322, group=4322)
    try:
        assert not mlflow_ui.auto_start_allowed()  # someone logged in since
        # A call's link: no server runs, and none is started now.
        assert mlflow_ui.run_url(store, "0", "0" * 32) is None
        assert mlflow_ui.server_port(store, start=False) is None
    finally:
        other.kill()
        other.wait()


def test_only_the_links_own_names_are_allowed_never_a_wildcard(monkeypatch):
    """What the server answers (issue 48, item 12): the link's host and origin, the hub's public
    one behind jupyter-server-proxy, and the loopback names (on any port: a tunnel's); never ``*``."""
    for name in (mlflow_ui.URL_ENV, "JUPYTERHUB_SERVICE_PREFIX", "JUPYTERHUB_PUBLIC_URL", "JUPYTERHUB_HOST"):
        monkeypatch.delenv(name, raising=False)
    loopback = ["127.0.0.1:5123", "localhost:5123", "127.0.0.1:*", "localhost:*"]
    assert mlflow_ui.allowed_names(5123) == (loopback, ["http://127.0.0.1:5123"])
    monkeypatch.setenv(mlflow_ui.URL_ENV, "http://localhost:{port}")
    assert mlflow_ui.allowed_names(5123) == (loopback, ["http://localhost:5123"])
    monkeypatch.setenv(mlflow_ui.URL_ENV, "https://Hub.Example:443/user/ada/proxy/{port}/")
    assert mlflow_ui.allowed_names(5123) == ([*loopback, "hub.example"], ["https://hub.example"])
    monkeypatch.delenv(mlflow_ui.URL_ENV)
    if importlib.util.find_spec("jupyter_server_proxy") is not None:
        monkeypatch.setenv("JUPYTERHUB_SERVICE_PREFIX", "/user/ada/")
        assert mlflow_ui.allowed_names(5123) == (loopback, [])  # the hub's name unknown: none
        monkeypatch.setenv("JUPYTERHUB_PUBLIC_URL", "https://hub.example:8443/user/ada/")
        assert mlflow_ui.allowed_names(5123) == (
            [*loopback, "hub.example:8443"],
            ["https://hub.example:8443"],
        )
    with pytest.raises(ValueError):
        ui_server.server_command("/f", 5123, ["*"])
    with pytest.raises(ValueError):
        ui_server.server_command("/f", 5123, loopback, ["*"])


def _ask(port: int, method: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str]]:
    """One request to the server on loopback, with the headers a browser (or an attacker's page) sends."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=b"{}" if method == "POST" else None, headers=headers)
        reply = conn.getresponse()
        reply.read()
        return reply.status, {k.lower(): v for k, v in reply.getheaders()}
    finally:
        conn.close()


def test_a_tunnel_link_allows_its_own_host_and_origin_and_no_other(store, monkeypatch):
    """``AIR_MAGIC_MLFLOW_UI_URL=http://localhost:{port}`` (an SSH tunnel) once made the server
    accept any Host and any origin: DNS rebinding and any page's cross-origin reads and deletes."""
    monkeypatch.setenv(mlflow_ui.URL_ENV, "http://localhost:{port}")
    base = mlflow_ui.ensure_ui(store, timeout_s=UP_WAIT_S)
    port = int(base.rsplit(":", 1)[1])
    assert base == f"http://localhost:{port}"
    read = "/ajax-api/2.0/mlflow/experiments/search?max_results=1"
    delete = "/ajax-api/2.0/mlflow/runs/delete"
    # DNS rebinding: a name of the attacker's, resolved to 127.0.0.1, sends its own Host.
    assert _ask(port, "GET", read, {"Host": "evil.example"})[0] == 403
    assert _ask(port, "GET", read, {"Host": f"evil.example:{port}"})[0] == 403
    assert _ask(port, "GET", read, {"Host": f"localhost:{port}"})[0] == 200
    # Another site's page in the user's browser: its preflight for a delete is not allowed...
    preflight = {
        "Host": f"localhost:{port}",
        "Origin": "http://evil.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    _, headers = _ask(port, "OPTIONS", delete, preflight)
    assert headers.get("access-control-allow-origin") not in ("*", "http://evil.example"), headers
    # ...nor is the delete itself, nor may it read what a GET answers.
    post = {"Host": f"localhost:{port}", "Origin": "http://evil.example", "Content-Type": "application/json"}
    assert _ask(port, "POST", delete, post)[0] == 403
    _, headers = _ask(port, "GET", read, {"Host": f"localhost:{port}", "Origin": "http://evil.example"})
    assert headers.get("access-control-allow-origin") not in ("*", "http://evil.example"), headers
    # The link's own origin (the page the UI serves) is allowed.
    _, headers = _ask(port, "OPTIONS", delete, {**preflight, "Origin": f"http://localhost:{port}"})
    assert headers.get("access-control-allow-origin") == f"http://localhost:{port}", headers


def test_the_ui_server_gets_a_minimal_environment_without_the_starters_secrets(store, monkeypatch):
    """The shared server lives up to a day: it gets what runs Python and MLflow, never the starting
    kernel's secrets (issue 48, item 14)."""
    secret = f"s3cr3t-{os.getpid()}-{time.time_ns()}"
    monkeypatch.setenv("MY_API_TOKEN", secret)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", secret)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("LC_MESSAGES", "C")
    mlflow_ui.ensure_ui(store, timeout_s=UP_WAIT_S)
    record = _record()
    pids = [int(record["keeper"].split("-", 1)[0]), int(record["server"].split("-", 1)[0])]
    pids += [c.pid for c in psutil.Process(pids[1]).children(recursive=True)]
    for pid in pids:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
        assert secret.encode() not in environ, pid
        names = {item.split(b"=", 1)[0].decode() for item in environ.split(b"\0") if item}
        assert {"MY_API_TOKEN", "MLFLOW_TRACKING_PASSWORD", "AWS_SECRET_ACCESS_KEY"}.isdisjoint(names)
        assert {"PATH", "LC_MESSAGES", "MLFLOW_BACKEND_STORE_URI"} <= names, (pid, names)


def test_a_record_of_another_boot_or_container_is_never_trusted_nor_signalled(store):
    """A home folder outlives boots and containers (and may be shared by machines): a record made
    elsewhere names a pid of another pid space, which must not count as alive nor be signalled."""
    folder = mlflow_ui.ui_folder(store)
    elsewhere = os.path.join(folder, paths.MLFLOW_UI_STATE.format(space="0123456789abcdef"))
    key = mlflow_ui._key(store)
    ui_server.write_record(elsewhere, {"keeper": "1-1-0123456789abcdef", "port": 5000, "uri_key": key})
    # Ours, naming a keeper of this space that is gone (pid 1 with a start time it never had).
    ui_server.write_record(
        ui_server.state_path(folder),
        {"keeper": f"1-12345-{private_files.pid_space()}", "port": 5000, "uri_key": key},
    )
    assert mlflow_ui.server_port(store, start=False) is None
    assert mlflow_ui.stop_ui(store) is False  # nothing signalled: pid 1 is this container's init


def test_relative_stores_are_made_absolute_and_passwords_are_not_shown(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert mlflow_ui.absolute("sqlite:///mlflow.db") == f"sqlite:///{tmp_path}/mlflow.db"
    assert mlflow_ui.absolute("sqlite:////abs/m.db") == "sqlite:////abs/m.db"
    assert mlflow_ui.absolute("file:./mlruns") == f"file://{tmp_path}/mlruns"
    assert mlflow_ui.absolute("mlruns") == f"{tmp_path}/mlruns"
    assert mlflow_ui.absolute("http://host:5000") == "http://host:5000"
    shown = mlflow_ui.open_command("postgresql://ada:s3cret@db:5432/mlflow", "abc")
    assert "s3cret" not in shown and "ada:***@db:5432" in shown
    assert mlflow_ui.run_url("databricks", "1", "abc") is None  # no page this URI can name


def _status(port: int, host: str, origin: str | None = None) -> int:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/ajax-api/2.0/mlflow/experiments/search",
        data=b'{"max_results": 1}',
        headers={"Host": host, "Content-Type": "application/json", **({"Origin": origin} if origin else {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def test_behind_a_proxy_the_hubs_host_reaches_the_server_and_not_otherwise(store, monkeypatch):
    """jupyter-server-proxy forwards the browser's Host and Origin (the hub's name): the server
    accepts the hub's name only when it serves through a proxy of a hub that names itself
    (JUPYTERHUB_PUBLIC_URL), and no other name (issue 48 item 12); on plain loopback MLflow's
    guard stays."""
    pytest.importorskip("jupyter_server_proxy")
    port = int(mlflow_ui.ensure_ui(store).rsplit(":", 1)[1])
    assert _status(port, f"127.0.0.1:{port}") == 200
    assert _status(port, "hub.example.org", "https://hub.example.org") == 403  # DNS rebinding guard
    assert mlflow_ui.stop_ui(store)
    monkeypatch.setenv("JUPYTERHUB_SERVICE_PREFIX", "/user/ada/")
    monkeypatch.setenv("JUPYTERHUB_PUBLIC_URL", "https://hub.example.org/user/ada/")
    base = mlflow_ui.ensure_ui(store)
    assert base.startswith("/user/ada/proxy/")
    port = int(base.rsplit("/", 1)[1])
    assert _status(port, "hub.example.org", "https://hub.example.org") == 200
    assert _status(port, "evil.example", "https://evil.example") == 403
