"""The seed's remaining details (issue 20, SPEC §9 last bullet, §16), against real ranks and a real store.

System metrics sampled in the caller, rank logs in the run while it runs, a call
resuming an existing run, and the seed's small API: ``remote=``, ``GPUType``,
legacy types, the decorator's properties, ``air_magic.runtime``,
``init_process_group(tf32=, timeout=)``, ``get_changelog()``, ``help()``.
"""

from __future__ import annotations

import pydoc
import time
import warnings
from pathlib import Path

import pytest

import air_magic
from air_magic import ConfigurationError, distributed, runtime
from air_magic.tracking import log_upload

# --- the seed's small API (no store needed) ------------------------------------------------


def test_remote_false_is_the_local_mode_and_remote_true_says_where_to_go():
    fn = distributed(num_accelerators=2, remote=False)(lambda: 1)
    assert fn.num_accelerators == 2
    with pytest.raises(ConfigurationError, match=r"cluster='ray'.*air-magic run"):
        distributed(remote=True)


def test_gpu_type_and_legacy_values_suggest_the_type_with_the_count():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn = distributed(gpus=1, gpu_type=air_magic.GPUType.H100)(lambda: 1)
    (warning,) = [w for w in caught if w.category is FutureWarning]
    assert "'H100' -> 'GPU_1xH100'" in str(warning.message)
    assert fn.num_accelerators == 1 and fn.accelerator_type == "GPU_1xH100"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distributed(accelerator_type="H100")
    assert "'H100' -> 'GPU_8xH100'" in str(caught[0].message)  # no count: the node the seed meant
    fn = distributed(accelerator_type=air_magic.AcceleratorType.GPU_8xH100)(lambda: 1)
    assert fn.accelerator_type == "GPU_8xH100" and fn.num_accelerators is None
    assert distributed(lambda: 1).accelerator_type is None


def test_help_shows_the_real_defaults_and_the_changelog_is_there():
    text = pydoc.render_doc(distributed, renderer=pydoc.plaintext)
    assert "timeout: 'Any' = 10800.0" in text and "display: 'Any' = 'auto'" in text
    assert "<object object" not in text
    changelog = air_magic.get_changelog()
    assert changelog.startswith("# Changelog") and "resum" in changelog


def test_outside_a_call_the_world_is_one_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert (runtime.get_rank(), runtime.get_world_size()) == (0, 1)
    assert (runtime.get_local_rank(), runtime.get_local_world_size(), runtime.get_node_rank()) == (0, 1, 0)


def _rank_facts():
    import torch

    from air_magic import init_process_group, runtime

    before = (runtime.get_rank(), runtime.get_world_size(), runtime.get_local_rank())
    init_process_group(timeout=30, tf32=True)
    # A rank that returned right after gloo's connect could close its socket while its peer still
    # finished its side of the handshake ("Connection closed by peer", seen once under load): real
    # code runs collectives next; this one waits for the peer, as they do.
    torch.distributed.barrier()
    return {
        "env": before,
        "dist": (runtime.get_rank(), runtime.get_world_size()),
        "local": (runtime.get_local_world_size(), runtime.get_node_rank()),
        "tf32": (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32),
    }


def _mismatched_group(path):
    import torch.distributed as dist

    from air_magic import runtime

    # A group of one per rank (a user's mistake): its numbers are not the launch's.
    dist.init_process_group(
        "gloo", store=dist.FileStore(f"{path}-{runtime.get_local_rank()}", 1), rank=0, world_size=1
    )
    try:
        runtime.get_world_size()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_runtime_helpers_in_real_ranks_agree_with_torch_distributed(tmp_path):
    settings = dict(num_accelerators=2, display="none", tracking=False)  # they read variables: warm is enough
    facts = distributed(**settings)(_rank_facts).distributed()
    assert [f["env"] for f in facts] == [(0, 2, 0), (1, 2, 1)]
    assert [f["dist"] for f in facts] == [(0, 2), (1, 2)]
    assert all(f["local"] == (2, 0) and f["tf32"] == (True, True) for f in facts)
    said = distributed(**settings)(_mismatched_group).distributed(str(tmp_path / "group"))
    assert all("torch.distributed says 1 but the launch set WORLD_SIZE=2" in s for s in said), said


# --- MLflow: system metrics, live logs, resumption --------------------------------------------


def _steady(seconds, gate=None):
    import os
    import time

    import mlflow

    rank = int(os.environ["RANK"])
    print(f"rank {rank} started", flush=True)
    mlflow.log_metric(f"call_marker_rank{rank}", float(os.environ.get("CALL_NUMBER", "1")))
    if gate is not None:
        while not os.path.exists(gate):
            time.sleep(0.05)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:  # a little real work for the CPU sampler to see
        sum(i * i for i in range(10_000))
    print(f"rank {rank} done", flush=True)
    return rank


def test_system_metrics_are_sampled_in_the_caller_and_can_be_turned_off(store, monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
    fn = distributed(num_accelerators=2, display="none")(_steady)
    fn.distributed(3.5)  # longer than two sampling intervals
    run = _last(store)
    keys = {k for k in run.data.metrics if k.startswith("system/")}
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= keys, keys
    assert any(k.startswith("system/disk_") for k in keys) and any(
        k.startswith("system/network_") for k in keys
    )
    history = store.get_metric_history(run.info.run_id, "system/cpu_utilization_percentage")
    assert len(history) >= 2  # one sampler: one value per interval, not one per rank
    assert len({m.step for m in history}) == len(history)
    fn.with_overrides(system_metrics=False).distributed(2.5)
    assert not [k for k in _last(store).data.metrics if k.startswith("system/")]


def _last(client):
    (exp,) = [e for e in client.search_experiments() if e.name != "Default"]
    return client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])[0]


def _artifact_text(client, run_id, path):
    local = client.download_artifacts(run_id, path)
    return Path(local).read_text()


def test_rank_logs_reach_the_run_while_it_runs(store, monkeypatch, tmp_path):
    monkeypatch.setattr(log_upload, "UPLOAD_EVERY_S", 0.5)  # 30 s in use: the pace, not the behaviour
    gate = tmp_path / "gate"
    handle = distributed(num_accelerators=2, display="none")(_steady).distributed_async(0.1, str(gate))
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                run = _last(store)
                seen = _artifact_text(store, run.info.run_id, "logs/rank-1.log")
            except Exception:  # noqa: BLE001 - the run, or its log, is not there yet
                seen = ""
            if "rank 1 started" in seen:
                break
            assert time.monotonic() < deadline, "the rank's log did not reach the run while it ran"
            time.sleep(0.2)
        assert store.get_run(run.info.run_id).info.status == "RUNNING"  # mid-run, truly
        assert "rank 1 done" not in seen
    finally:
        gate.touch()
    assert handle.result(timeout=120) == [0, 1]
    final = _artifact_text(store, run.info.run_id, "logs/rank-1.log")
    assert final.startswith("rank 1 started") and "rank 1 done" in final
    assert final == Path(handle.run_result().log_dir, "rank-1.log").read_text()


def _fail_once(number):
    import os

    import mlflow

    mlflow.log_metric("resumed_call", number + int(os.environ["RANK"]) / 10, step=number)
    if number == 3 and os.environ["RANK"] == "1":
        raise ValueError("the third call fails")
    return number


def test_a_call_resumes_an_existing_run_and_ends_it_truthfully(store, monkeypatch, capfd):
    fn = distributed(num_accelerators=2, display="none")(_fail_once)
    fn.distributed(1)
    first = _last(store)
    run_id = first.info.run_id
    fn.with_overrides(run_id=run_id, timeout=600).distributed(2)
    run = store.get_run(run_id)
    assert len(store.search_runs([first.info.experiment_id])) == 1  # no new run
    assert run.info.status == "FINISHED" and run.data.tags["air_magic.calls"] == "2"
    assert sorted(m.value for m in store.get_metric_history(run_id, "resumed_call")) == [1.0, 1.1, 2.0, 2.1]
    assert run.data.params["timeout_s"] == "10800" and run.data.params["call-2.timeout_s"] == "600"
    logs = {a.path for a in store.list_artifacts(run_id, "logs/call-2")}
    assert {"logs/call-2/rank-0.log", "logs/call-2/rank-1.log"} <= logs
    assert "logs/rank-0.log" in {a.path for a in store.list_artifacts(run_id, "logs")}  # call 1's kept
    # MLFLOW_RUN_ID set in the caller: that run, said in one line; a failing call ends it FAILED.
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    with pytest.raises(ValueError, match="the third call fails"):  # the rank's own error
        fn.distributed(3)
    assert f"this call is recorded in run {run_id} (resumed, not a new run)" in capfd.readouterr().err
    run = store.get_run(run_id)
    assert run.info.status == "FAILED" and run.data.tags["air_magic.calls"] == "3"
    assert run.data.tags["air_magic.failed_rank"] == "1"
    monkeypatch.delenv("MLFLOW_RUN_ID")
    # Bad input: refused before any rank starts, the run untouched.
    with pytest.raises(ConfigurationError, match="no such MLflow run"):
        fn.with_overrides(run_id="0" * 32).distributed(4)
    with pytest.raises(ConfigurationError, match="not of experiment='elsewhere'"):
        fn.with_overrides(run_id=run_id, experiment="elsewhere").distributed(4)
    assert store.get_run(run_id).info.status == "FAILED"
    assert max(m.value for m in store.get_metric_history(run_id, "resumed_call")) < 4
    # A session's start says it as a one-off call does (was: SessionEndedError, and "logs: " empty).
    import air_magic

    capfd.readouterr()
    with pytest.raises(ConfigurationError, match="no such MLflow run"):
        air_magic.session(num_accelerators=1, display="text", mlflow_run_id="0" * 32).start()
    said = capfd.readouterr()
    assert "logs: \n" not in said.out + said.err and not said.out.rstrip().endswith("logs:"), said
