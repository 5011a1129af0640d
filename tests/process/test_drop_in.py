"""Drop-in for torchrun (issue 33, SPEC §17): what a rank sees and reports, with torchrun as the oracle.

The same file runs under ``python -m torch.distributed.run`` (torchrun) and under ``air-magic run``;
the test compares what each rank saw or what each launcher said.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers.cli import environment, invoke

from air_magic.protocol.elastic_error_file import error_file_path

# torchrun's own numbers and words, which must be the same under air_magic (paths, ports and ids differ).
SAME_VALUES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)

SEES = """\
import json, os, sys
with open(os.path.join(sys.argv[1], f"{sys.argv[2]}-{os.environ['RANK']}.json"), "w") as f:
    json.dump(dict(os.environ), f)
"""

RECORDED = """\
import os
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    if os.environ["RANK"] == "1":
        raise ValueError("bad batch 7")

try:
    main()
except ValueError:
    os._exit(1)  # a hard exit after the framework's own handling: only the error file speaks
"""


def torchrun(*args: str, cwd, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """torchrun on one node, its store on a free port (--standalone: never 29500)."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args],
        cwd=cwd,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_rank_sees_every_variable_torchrun_sets(tmp_path):
    (tmp_path / "sees.py").write_text(SEES)
    oracle = torchrun("--role=trainer", "sees.py", str(tmp_path), "torchrun", cwd=tmp_path)
    assert oracle.returncode == 0, oracle.stderr
    line = ("--standalone", "--nproc-per-node=2", "--role=trainer")
    ours = invoke("run", "--no-tracking", *line, "sees.py", str(tmp_path), "ours", cwd=tmp_path)
    assert ours.returncode == 0, ours.stderr
    parent = set(environment())
    for rank in (0, 1):
        theirs = json.loads((tmp_path / f"torchrun-{rank}.json").read_text())
        mine = json.loads((tmp_path / f"ours-{rank}.json").read_text())
        missing = sorted(set(theirs) - parent - set(mine))
        assert not missing, f"torchrun sets these for rank {rank}, air_magic does not: {missing}"
        assert {k: mine[k] for k in SAME_VALUES} == {k: theirs[k] for k in SAME_VALUES}
        # Each rank's own error file, in its call folder (private, removed after the call).
        assert mine["TORCHELASTIC_ERROR_FILE"] == error_file_path(mine["AIR_MAGIC_RUN_DIR"], rank)
        assert not os.path.exists(mine["AIR_MAGIC_RUN_DIR"])


@pytest.mark.fault(
    "a rank's @record writes torchrun's error file, then the rank exits without a report of its own",
    "the caller's error is that rank's exception, type, message and traceback, from the error file",
)
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "fresh"])
def test_an_error_file_written_by_record_is_the_ranks_error(tmp_path, warm):
    (tmp_path / "recorded.py").write_text(RECORDED)
    ours = invoke("run", "--no-tracking", *([] if warm else ["--no-warm-start"]), "recorded.py", cwd=tmp_path)
    assert ours.returncode == 1, ours.stderr
    assert "rank 1 of 2 raised ValueError: bad batch 7" in ours.stderr
    assert "TORCHELASTIC_ERROR_FILE" in ours.stderr
    assert 'raise ValueError("bad batch 7")' in ours.stderr  # the traceback @record took
    if warm:  # the oracle says the same (once: it does not depend on how our ranks start)
        oracle = torchrun("recorded.py", cwd=tmp_path)
        assert oracle.returncode == 1
        assert "ValueError: bad batch 7" in oracle.stderr


@pytest.mark.parametrize(
    "line",
    [
        ["--nproc_per_node", "3"],
        ["--nnodes", "1", "--node-rank", "0", "--nproc-per-node", "3", "--max-restarts", "0"],
        ["--module", "sees"],  # torchrun's spelling of -m; PET_NPROC_PER_NODE gives the 3 ranks
    ],
    ids=["underscores", "single-node-flags", "module-and-PET"],
)
def test_torchruns_command_lines_run_unchanged(tmp_path, line, monkeypatch):
    (tmp_path / "sees.py").write_text(SEES)
    if "--module" in line:
        monkeypatch.setenv("PET_NPROC_PER_NODE", "3")  # as torchrun reads it (helpers.cli passes it on)
    else:
        line = [*line, "sees.py"]
    done = invoke("run", "--no-tracking", *line, str(tmp_path), "ours", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    seen = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("ours-*.json"))]
    assert [(s["RANK"], s["WORLD_SIZE"]) for s in seen] == [("0", "3"), ("1", "3"), ("2", "3")]


def test_options_with_no_effect_here_say_so_and_those_beyond_this_machine_are_refused(tmp_path):
    (tmp_path / "sees.py").write_text(SEES)
    said = invoke(
        "run", "--no-tracking", "--master-port=29500", "--rdzv-backend=c10d", "-t", "3", "--nproc-per-node=1",
        "sees.py", str(tmp_path), "ours", cwd=tmp_path,
    )  # fmt: skip
    assert said.returncode == 0, said.stderr
    assert "--master-port=29500: no effect here (air_magic hosts the rendezvous store itself" in said.stderr
    assert "--rdzv-backend=c10d: no effect here" in said.stderr and "--tee=3: no effect here" in said.stderr
    for line, words in [
        (["--nnodes=2"], "--nnodes=2: air-magic run starts every rank from this one machine"),
        (["--node-rank=1"], "--node-rank=1: air-magic run is run once"),
        (["-n", "3", "--nproc-per-node=2"], "-n 3 and --nproc-per-node=2 disagree"),
        (["--nproc-per-node=many"], "give a number, auto, gpu or cpu"),
    ]:
        refused = invoke("run", "--no-tracking", *line, "sees.py", cwd=tmp_path)
        assert refused.returncode == 2 and words in refused.stderr, (line, refused.stderr)


FAILS_ONCE = """import os, sys
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"attempt {attempt} of {int(os.environ['TORCHELASTIC_MAX_RESTARTS']) + 1}", flush=True)
if attempt == "0" and os.environ["RANK"] == "1":
    raise RuntimeError("a node's disk was full")
"""


def test_max_restarts_starts_every_rank_again_as_torchrun_does(tmp_path):
    (tmp_path / "fails_once.py").write_text(FAILS_ONCE)
    oracle = torchrun("--max-restarts=1", "fails_once.py", cwd=tmp_path)
    assert oracle.returncode == 0, oracle.stderr
    ours = invoke("run", "--no-tracking", "--max-restarts=1", "fails_once.py", cwd=tmp_path)
    assert ours.returncode == 0, ours.stderr
    assert "attempt 1 of 2 failed (" in ours.stderr and "TORCHELASTIC_RESTART_COUNT=1" in ours.stderr
    # Rank 0's first line may not come before the failure stops it (a busy machine): the others must.
    assert "[rank 1] attempt 0 of 2" in ours.stdout
    assert "[rank 0] attempt 1 of 2" in ours.stdout and "[rank 1] attempt 1 of 2" in ours.stdout
    no_more = invoke("run", "--no-tracking", "--max-restarts=0", "fails_once.py", cwd=tmp_path)
    assert no_more.returncode == 1 and "a node's disk was full" in no_more.stderr


def test_a_tracked_restart_resumes_the_same_mlflow_run(tmp_path, store):
    """Each attempt of --max-restarts is recorded in the first attempt's MLflow run (the setting
    that resumes it is mlflow_run_id; its old name run_id once broke this path)."""
    (tmp_path / "fails_once.py").write_text(FAILS_ONCE)
    ours = invoke("run", "--max-restarts=1", "fails_once.py", cwd=tmp_path)
    assert ours.returncode == 0, ours.stderr
    runs = store.search_runs([e.experiment_id for e in store.search_experiments()])
    seen = [(r.info.run_id, r.info.status) for r in runs]
    assert len(runs) == 1 and runs[0].info.status == "FINISHED", seen


def test_local_ranks_filter_shows_those_ranks_and_the_logs_keep_every_rank(tmp_path):
    (tmp_path / "hello.py").write_text("import os\nprint(f\"hello from {os.environ['RANK']}\")\n")
    done = invoke("run", "--no-tracking", "--local-ranks-filter=1", "hello.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "[rank 1] hello from 1" in done.stdout and "hello from 0" not in done.stdout
    assert "hello from 0" in invoke("logs", "last", "0").stdout


def test_no_python_runs_a_program_on_every_rank(tmp_path):
    done = invoke(
        "run", "--no-tracking", "--no-python", "sh", "-c", "echo rank=$RANK of $WORLD_SIZE", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "[rank 0] rank=0 of 2" in done.stdout and "[rank 1] rank=1 of 2" in done.stdout
    failed = invoke("run", "--no-tracking", "--no_python", "sh", "-c", "exit $((RANK + 3))", cwd=tmp_path)
    assert failed.returncode in (3, 4), failed.stderr  # the root-cause rank's status, as torchrun's
    missing = invoke("run", "--no-python", "no-such-program-here", cwd=tmp_path)
    assert missing.returncode == 2 and "no such program: no-such-program-here" in missing.stderr


ARGV0 = """\
import os, sys
with open(os.path.join(sys.argv[1], f"{sys.argv[2]}-{os.environ['RANK']}.txt"), "w") as f:
    f.write(sys.argv[0])
"""


def test_a_scripts_argv0_is_the_path_as_typed_as_under_torchrun(tmp_path):
    """Issue 48 #18: a rank's sys.argv[0] was the script's absolute path; torchrun passes it as typed."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "argv0.py").write_text(ARGV0)
    typed = os.path.join("sub", "argv0.py")
    oracle = torchrun(typed, str(tmp_path), "torchrun", cwd=tmp_path)
    assert oracle.returncode == 0, oracle.stderr
    ours = invoke("run", "--no-tracking", "-n", "2", typed, str(tmp_path), "ours", cwd=tmp_path)
    assert ours.returncode == 0, ours.stderr
    for rank in (0, 1):
        theirs = (tmp_path / f"torchrun-{rank}.txt").read_text()
        assert theirs == typed  # the oracle: as typed
        assert (tmp_path / f"ours-{rank}.txt").read_text() == theirs
