"""A persistent session on real GPUs (issue 22; run on the device): NCCL set up once, CUDA memory in
the header, state and CUDA tensors kept across cells, an interrupted GPU loop, nothing left after stop.

python -m pytest -m gpu -s tests/gpu/test_session_gpu.py
"""

from __future__ import annotations

import statistics
import time

import psutil
import pytest

import air_magic
from air_magic.calls import persistent
from air_magic.launch.accelerators import detect_gpus

GPUS = detect_gpus()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not GPUS, reason="no NVIDIA GPU visible through NVML"),
]


def test_a_gpu_session_keeps_cuda_state_and_shows_its_memory():
    n = len(GPUS)
    with air_magic.session(num_accelerators=n, display="text", tracking=False, timeout=120) as s:
        assert s.run_cell("import torch.distributed as dist\ndist.get_backend()") == ["nccl"] * n
        # 1 GiB per rank, kept for the next cells
        s.run_cell("import torch\nx = torch.ones(256, 1024, 1024, device='cuda')")
        held = [s.call.memory[r] for r in range(n)]
        assert all(m["gpu"] >= 1 << 30 and m["device"] == r for r, m in enumerate(held)), held
        assert "GPU memory in use" in s.status() and "cuda:0" in s.status()
        summed = s.run_cell("t = x[0, 0, :1].clone()\ndist.all_reduce(t)\nt.item()")
        assert summed == [float(n)] * n
        # a failing cell keeps the session and its tensors
        with pytest.raises(ZeroDivisionError):
            s.run_cell("1 / 0")
        assert s.run_cell("float(x.sum() / x.numel())") == [1.0] * n
        # a GPU loop past its cell's timeout: interrupted between kernels, the session goes on
        with pytest.raises(TimeoutError, match="goes on"):
            s.run_cell(
                "y = torch.randn(4096, 4096, device='cuda')\nwhile True:\n    y = (y @ y).tanh()\n", timeout=5
            )
        assert s.run_cell("x.shape[0]") == [256] * n
        # the per-cell cost on this machine (display off), printed for the record
        took = []
        for _ in range(50):
            start = time.perf_counter()
            s.run_cell("1")
            took.append(time.perf_counter() - start)
        print(f"\nsession cell on {n} GPU rank(s): median {statistics.median(took) * 1e3:.2f} ms")
        pids = list(s.call.pids.values())
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(psutil.pid_exists(p) for p in pids)
    assert persistent.active() is None
