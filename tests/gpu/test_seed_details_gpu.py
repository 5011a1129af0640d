"""The seed's details on a real GPU (issue 20; run on the device): GPU system metrics, rank helpers.

python -m pytest -m gpu tests/gpu/test_seed_details_gpu.py
"""

from __future__ import annotations

import pytest

import air_magic
from air_magic.launch.accelerators import detect_gpus

GPUS = detect_gpus()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not GPUS, reason="no NVIDIA GPU visible through NVML"),
]


def gpu_work(seconds: float) -> str:
    import time

    import torch

    from air_magic import init_process_group, runtime

    device = init_process_group(timeout=60, tf32=True)
    x = torch.randn(4096, 4096, device=device)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        x = (x @ x).tanh()
        torch.cuda.synchronize()
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert runtime.get_world_size() == torch.distributed.get_world_size()
    return f"{device} rank {runtime.get_rank()} local {runtime.get_local_rank()}"


def test_gpu_system_metrics_are_sampled_in_the_caller(store, monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
    said = air_magic.distributed(num_accelerators=1, display="none")(gpu_work).distributed(5.0)
    assert said == ["cuda:0 rank 0 local 0"]
    run = store.get_run(air_magic.last_run().mlflow_run_id)
    keys = {k for k in run.data.metrics if k.startswith("system/")}
    print(sorted(keys))
    assert "system/gpu_0_utilization_percentage" in keys and "system/gpu_0_memory_usage_megabytes" in keys
    assert "system/cpu_utilization_percentage" in keys
    history = store.get_metric_history(run.info.run_id, "system/gpu_0_utilization_percentage")
    print("gpu_0 utilization samples:", [m.value for m in history])
    assert len(history) >= 2
