"""A call this machine could never start is refused before anything of it exists (SPEC §6).

Issue 49's probe: ``-n 99999`` gave raw "Too many open files" tracebacks from inside the ranks'
start, no run.json, and an MLflow run left RUNNING. Now the number of ranks is checked against the
process's hard open-file limit when the call is planned: one clear error, no run, no log folder.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

CALLER = textwrap.dedent(
    """
    import json, os, resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512))  # this process's hard limit: 512
    import air_magic

    def rank():
        return 1

    fn = air_magic.distributed(num_accelerators=100, display="none", warm_start=False)(rank)
    try:
        fn.distributed()
    except Exception as exc:
        said = f"{type(exc).__name__}: {exc}"
    else:
        said = None
    print(json.dumps({"said": said}))
    """
)


def test_more_ranks_than_the_hard_open_file_limit_allows_are_refused_before_the_call(tmp_path, store):
    logs = tmp_path / "logs"
    env = {"AIR_MAGIC_LOG_DIR": str(logs), "AIR_MAGIC_MLFLOW_UI": "0", "AIR_MAGIC_CPU_RANKS": "2"}
    import os

    done = subprocess.run(
        [sys.executable, "-c", CALLER], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])["said"]
    assert said.startswith("ConfigurationError: 100 ranks need about"), said
    assert "hard limit of 512 (ulimit -Hn)" in said, said
    assert "Too many open files" not in done.stderr, done.stderr[-2000:]
    assert not logs.exists() or not any(logs.iterdir())  # no log folder: nothing of the call began
    experiments = store.search_experiments()
    runs = store.search_runs([e.experiment_id for e in experiments])
    assert runs == []  # no MLflow run, RUNNING or otherwise


def test_ui_for_a_run_that_is_not_there_is_refused_and_starts_no_server(tmp_path, monkeypatch):
    """``air-magic ui --run BADID`` / ``%distributed ui --run BADID`` was refused, and had started
    the UI server (which outlives the command) first."""
    import pytest

    from air_magic import verbs
    from air_magic.errors import ConfigurationError
    from air_magic.tracking import ui as mlflow_ui

    started: list[str] = []
    monkeypatch.setattr(mlflow_ui, "ensure_ui", lambda uri: started.append(uri) or "http://127.0.0.1:1")
    with pytest.raises(ConfigurationError, match="no MLflow run 'nosuchrun'"):
        verbs.ui_page(f"sqlite:///{tmp_path}/mlflow.db", "nosuchrun")
    assert started == []
