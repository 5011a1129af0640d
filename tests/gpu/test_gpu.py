"""The real GPU path, run on the device (2xH200); skipped on machines without an NVIDIA GPU.

python -m pytest -m gpu tests/gpu
"""

from __future__ import annotations

import os

import pytest

from air_magic import AcceleratorError, distributed
from air_magic.launch.accelerators import describe, detect_gpus

GPUS = detect_gpus()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not GPUS, reason="no NVIDIA GPU visible through NVML"),
]


def pids_on_gpus() -> set[int]:
    """Every process NVML sees holding a CUDA context (used in ranks and in the test process)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        pids: set[int] = set()
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            pids |= {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        return pids
    finally:
        pynvml.nvmlShutdown()


def _caller_pid_on_gpu_and_nccl_sum():
    import os

    import torch
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    on_gpu = pids_on_gpus()
    dist.destroy_process_group()
    return {
        "sum": t.item(),
        "caller_on_gpu": int(os.environ["AIR_MAGIC_CALLER_PID"]) in on_gpu,
        "me_on_gpu": os.getpid() in on_gpu,
        "devices": torch.cuda.device_count(),
        "current": torch.cuda.current_device(),
        "tensor": t * 2,  # a CUDA tensor: must come back on the CPU
    }


def test_detection_names_this_machine():
    assert describe(GPUS).startswith(f"GPU_{len(GPUS)}x")
    print("detected:", describe(GPUS), [g.name for g in GPUS])


def test_nccl_all_reduce_on_every_gpu_and_the_caller_holds_no_cuda_context():

    out = distributed(display="text")(_caller_pid_on_gpu_and_nccl_sum).distributed()
    world = len(GPUS)
    assert [o["sum"] for o in out] == [float(world)] * world
    assert [o["current"] for o in out] == list(range(world))
    assert all(o["devices"] == world for o in out)
    assert not any(o["caller_on_gpu"] for o in out)
    assert all(o["tensor"].device.type == "cpu" for o in out)
    # And after the run: this process never appears on a GPU.
    assert os.getpid() not in pids_on_gpus()
    assert "torch" not in __import__("sys").modules or not __import__("torch").cuda.is_initialized()


def _visible():
    import os

    import torch

    return os.environ["CUDA_VISIBLE_DEVICES"], torch.cuda.device_count()


def test_a_subset_gets_the_right_cuda_visible_devices():
    out = distributed(num_accelerators=1, display="none")(_visible).distributed()
    assert out == [(str(GPUS[0].index), 1)]


def test_accelerator_type_is_checked_against_the_machine():
    here = describe(GPUS)
    with pytest.raises(AcceleratorError, match=here):
        distributed(accelerator_type="GPU_8xA10", display="none")(_visible).distributed()
    out = distributed(accelerator_type=here, display="none")(_visible).distributed()
    assert len(out) == len(GPUS)


def _helper():
    import torch.distributed as dist

    import air_magic

    device = air_magic.init_process_group()
    backend = dist.get_backend()
    dist.destroy_process_group()
    return str(device), backend


def test_init_process_group_helper_uses_nccl_on_gpus():
    out = distributed(display="none")(_helper).distributed()
    assert out == [(f"cuda:{i}", "nccl") for i in range(len(GPUS))]


def test_warm_ranks_use_the_gpus_and_the_starter_holds_no_cuda_context():

    from air_magic.node import warm

    fn = distributed(display="none")(_visible)
    fn.distributed()
    starter = warm.get_starter(wait_s=120)
    assert starter is not None
    out = distributed(display="none")(_caller_pid_on_gpu_and_nccl_sum).distributed()
    assert [o["sum"] for o in out] == [float(len(GPUS))] * len(GPUS)
    pids = pids_on_gpus()
    assert starter.proc.pid not in pids and os.getpid() not in pids


# -- the examples, as notebooks in a real kernel (issue #7) -------------------------------

EXAMPLES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"
)
NOTEBOOKS = {
    "seed_mlp.ipynb": ["Total loss for epoch 2:"],
    "ddp_progress.ipynb": ["rank 0: losses", "accuracy"],
    "fsdp2_transformer.ipynb": ["final loss"],
    "deepspeed_zero.ipynb": ["ZeRO-2:", "ZeRO-3:"],
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(NOTEBOOKS))
def test_example_notebook_on_every_gpu_while_the_kernel_holds_no_cuda_context(name):
    import threading

    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    from helpers.kernel import kernel_pid, notebook_client

    if name.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    nb = nbformat.read(os.path.join(EXAMPLES, name), as_version=4)
    # Last, the kernel reports on itself: has this process initialised CUDA?
    probe = (
        "import sys\n_t = sys.modules.get('torch')\n"
        "print('KERNEL_CUDA', bool(_t and _t.cuda.is_initialized()))"
    )
    nb.cells.append(nbformat.v4.new_code_cell(probe))
    client = notebook_client(nb, timeout=600, path=EXAMPLES)
    seen: dict[str, set[int]] = {"on_gpu": set(), "kernel": set()}
    done = threading.Event()

    def watch() -> None:  # NVML, every 0.2 s, for as long as the notebook runs
        while not done.wait(0.2):
            pid = kernel_pid(getattr(client, "km", None))
            if pid:
                seen["kernel"].add(pid)
            seen["on_gpu"] |= pids_on_gpus()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        client.execute()
    finally:
        done.set()
        watcher.join()
    kernel = seen["kernel"]
    assert kernel, "the kernel's pid was never seen"
    assert not (kernel & seen["on_gpu"]), "the notebook kernel held a CUDA context"
    assert "KERNEL_CUDA False" in "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    # Where NVML lists processes (not in every container), the ranks were seen on the GPUs.
    print(name, "processes NVML saw on the GPUs:", sorted(seen["on_gpu"]), "kernel:", sorted(kernel))
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    tabs = [m["state"]["titles"] for m in state.values() if m["model_name"] == "TabModel"]
    assert tabs and all(t == [f"rank {i} ✓" for i in range(len(GPUS))] for t in tabs), tabs
    shown = "".join(
        "".join(o.get("text", "") for o in m["state"].get("outputs", []))
        for m in state.values()
        if m["model_name"] == "OutputModel"
    )
    shown += "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    for expected in NOTEBOOKS[name]:
        assert expected in shown, (expected, shown[-2000:])
    if name == "seed_mlp.ipynb":
        _check_seed_metrics(len(GPUS))


def _check_seed_metrics(world: int) -> None:
    """Every rank's per-step loss of the seed's example is in the call's MLflow run."""
    from mlflow.tracking import MlflowClient

    from air_magic.paths import embedded_mlflow_uri as embedded_uri

    client = MlflowClient(embedded_uri())
    experiments = [e.experiment_id for e in client.search_experiments()]
    (run,) = client.search_runs(
        experiments,
        filter_string="tags.`mlflow.source.name` = 'run_train'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    assert run.info.status == "FINISHED"
    steps_per_rank = -(-5000 // world)
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 3 * steps_per_rank * world
    assert len(client.get_metric_history(run.info.run_id, "total_loss")) >= 1


def _cuda_random_facts():
    import os

    import torch

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return {
        "cuda_seed": torch.cuda.initial_seed(),
        "cuda_draw": torch.rand(2, device="cuda").tolist(),
        "cpu_seed": torch.initial_seed(),
    }


@pytest.mark.parametrize("warm_start", [True, False], ids=["warm", "fresh"])
def test_cuda_and_cpu_generators_are_fresh_per_rank_and_per_call(warm_start):
    """A fresh process seeds torch's CUDA and CPU generators from the OS (seen on the device:
    no fixed default). Warm ranks must too: the starter never created CUDA's generators, and
    each fork reseeds the CPU one (issue "Faithful ranks")."""
    fn = distributed(
        num_accelerators=min(2, len(GPUS)), display="none", tracking=False, warm_start=warm_start
    )(_cuda_random_facts)
    facts = fn.distributed() + fn.distributed()
    for key in ("cuda_seed", "cpu_seed"):
        values = [f[key] for f in facts]
        assert len(set(values)) == len(values), f"{key} repeats: {values}"
    assert len({tuple(f["cuda_draw"]) for f in facts}) == len(facts)


# -- a preload that asks CUDA (issue 33, item 5) -------------------------------------------

_PRELOAD_CALLER = """
import json, os, sys
from air_magic import distributed

def on_gpu():
    import os, torch
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    forked = os.getppid() != int(os.environ["AIR_MAGIC_CALLER_PID"])  # a fresh rank's parent: the caller
    return {"value": torch.ones(1, device="cuda").item(), "forked": forked}

print(json.dumps(distributed(display="none", tracking=False)(on_gpu).distributed()))
"""


@pytest.mark.parametrize(
    ("asks", "warm"),
    [
        ("torch.cuda.is_available()", True),  # through NVML in the starter: forks stay usable
        ("torch._C._cuda_getDeviceCount()", False),  # the driver itself: fresh ranks, one line says why
    ],
    ids=["is_available", "driver"],
)
def test_a_preload_that_asks_cuda_never_breaks_the_ranks(tmp_path, asks, warm):
    import json
    import subprocess
    import sys

    (tmp_path / "asks_cuda.py").write_text(f"import torch\n{asks}\n")
    (tmp_path / "caller.py").write_text(_PRELOAD_CALLER)
    where = os.pathsep.join([str(tmp_path), os.path.dirname(EXAMPLES), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "AIR_MAGIC_PRELOAD": "torch,asks_cuda", "PYTHONPATH": where}
    done = subprocess.run(
        [sys.executable, "caller.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert [o["value"] for o in out] == [1.0] * len(GPUS)
    assert all(o["forked"] is warm for o in out), out
    said = "importing 'asks_cuda' in the warm starter initialised CUDA"
    assert (said in done.stderr) is not warm, done.stderr
