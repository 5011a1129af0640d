"""The real GPU path, run on the device (2xH200); skipped on machines without an NVIDIA GPU.

python -m pytest -m gpu tests/gpu
"""

from __future__ import annotations

import os

import pytest

from air_magic import AcceleratorError, distributed
from air_magic.accelerators import describe, detect_gpus

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
    assert out == [(GPUS[0].uuid, 1)]


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

    from air_magic import warm

    fn = distributed(display="none")(_visible)
    fn.distributed()
    starter = warm.get_starter(wait_s=120)
    assert starter is not None
    out = distributed(display="none")(_caller_pid_on_gpu_and_nccl_sum).distributed()
    assert [o["sum"] for o in out] == [float(len(GPUS))] * len(GPUS)
    pids = pids_on_gpus()
    assert starter.proc.pid not in pids and os.getpid() not in pids
