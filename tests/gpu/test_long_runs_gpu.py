"""Long runs on a real GPU (run on the device; one GPU is enough): GPU claims, cancel, stacks, detach.

On the CPU machine these paths are tested with faked GPU plans (tests/process/test_background.py,
tests/process/test_detached.py); here the ranks hold a real CUDA context.

python -m pytest -m gpu tests/gpu/test_long_runs_gpu.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import air_magic
from air_magic.errors import ConfigurationError, DistributedTimeoutError
from air_magic.launch.accelerators import detect_gpus

GPUS = detect_gpus()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not GPUS, reason="no NVIDIA GPU visible through NVML"),
]


def busy_on_the_gpu(ready: str, gate: str) -> int:
    import os

    import torch

    x = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    open(ready, "w").close()
    while not os.path.exists(gate):
        x = (x @ x).tanh()
        torch.cuda.synchronize()
    return torch.cuda.device_count()


def stuck_in_cuda_sync() -> None:
    import torch

    torch.cuda._sleep(10**13)  # a kernel that spins for minutes
    torch.cuda.synchronize()  # the rank waits here, inside C code


def _wait_for(predicate, what: str, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_background_gpu_run_holds_its_gpu_shows_its_stacks_and_cancels(tmp_path):
    ready, gate = tmp_path / "ready", tmp_path / "gate"
    fn = air_magic.distributed(num_accelerators=1, display="none", tracking=False)(busy_on_the_gpu)
    handle = fn.distributed_async(str(ready), str(gate))
    _wait_for(ready.exists, "the rank's CUDA context")
    with pytest.raises(ConfigurationError, match="GPU 0, which busy_on_the_gpu"):
        fn.distributed(str(ready), str(gate))
    shared_gate = tmp_path / "shared-gate"
    shared = fn.with_overrides(share_gpus=True).distributed_async(str(tmp_path / "ready2"), str(shared_gate))
    dump = handle.stacks()
    assert "busy_on_the_gpu" in dump[0], dump
    shared_gate.touch()
    assert shared.result(timeout=120) == [1]
    # The device's NVML shows neither the processes nor their memory (measured: the same bytes
    # used before and during the run): a rank that is gone is what frees its CUDA context.
    pids = list(handle.rank_pids.values())
    assert all(psutil.pid_exists(p) for p in pids)
    assert handle.cancel() is True
    deadline = time.monotonic() + 5
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, "a cancelled rank is still there"
        time.sleep(0.05)
    assert handle.status == "cancelled"


def test_a_rank_stuck_in_cuda_shows_where_at_the_timeout():
    fn = air_magic.distributed(num_accelerators=1, display="none", tracking=False, timeout=15)(
        stuck_in_cuda_sync
    )
    with pytest.raises(DistributedTimeoutError) as caught:
        fn.distributed()
    assert "stuck_in_cuda_sync" in str(caught.value), str(caught.value)


def test_a_detached_gpu_run_holds_its_gpu_for_other_processes_and_is_attached(tmp_path):
    ready, gate = tmp_path / "ready", tmp_path / "gate"
    fn = air_magic.distributed(num_accelerators=1, display="none", tracking=False, detach=True)(
        busy_on_the_gpu
    )
    handle = fn.distributed_async(str(ready), str(gate))
    _wait_for(ready.exists, "the rank's CUDA context")
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            "import air_magic\n"
            "fn = air_magic.distributed(num_accelerators=1, display='none', tracking=False)(len)\n"
            "try:\n"
            "    fn.distributed('x')\n"
            "except air_magic.ConfigurationError as e:\n"
            "    print('refused:', e)\n"
            f"h = air_magic.attach({handle.detached_id!r}, display='none')\n"
            f"open({str(gate)!r}, 'w').close()\n"
            "print('result:', h.result(timeout=120))\n",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ},
    )
    assert f"refused: len would run on GPU 0, which detached run {handle.detached_id}" in other.stdout, other
    assert "result: [1]" in other.stdout, other
    assert handle.result(timeout=60) == [1]
    assert Path(gate).exists()
