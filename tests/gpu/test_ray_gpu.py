"""The Ray backend on real GPUs (run on the device): a local Ray with this machine's GPUs,
NCCL across the ranks of ``cluster="ray"``, and a seeded DDP job whose losses must equal
the local backend's.

python -m pytest -m gpu tests/gpu/test_ray_gpu.py
"""

from __future__ import annotations

import os

import pytest

from air_magic import distributed
from air_magic.launch.accelerators import detect_gpus

GPUS = detect_gpus()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not GPUS, reason="no NVIDIA GPU visible through NVML"),
]


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    import air_magic
    from air_magic.backends.ray import placement

    info = air_magic.ray_init()  # a local Ray with this machine's GPUs, loopback only
    assert info.resources.get("GPU") == len(GPUS), info
    yield info
    placement.release_all()
    ray.shutdown()


def nccl_sum():
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    dist.destroy_process_group()
    visible = os.environ["CUDA_VISIBLE_DEVICES"]
    return t.item(), visible, torch.cuda.device_count(), torch.cuda.get_device_name()


def ddp_losses(steps: int = 40):
    """A seeded DDP job: the same data and initial weights on every run, whoever launches it."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1234 + rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(128, 64, generator=gen).to(device)
        y = x[:, :10].argmax(1)  # learnable: the class is where the first ten features peak
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    dist.destroy_process_group()
    return losses


def test_nccl_all_reduce_through_ray_on_every_gpu(local_ray):
    n = len(GPUS)
    on_ray = distributed(num_accelerators=n, cluster="ray", display="text", tracking=False)
    values = on_ray(nccl_sum).distributed()
    assert [v[0] for v in values] == [float(n)] * n
    assert len({v[1] for v in values}) == n  # each rank its own GPU
    assert {v[2] for v in values} == {1}


def test_ddp_losses_through_ray_equal_the_local_backends(local_ray):
    n = len(GPUS)
    settings = {"num_accelerators": n, "display": "none", "tracking": False}
    local = distributed(**settings)(ddp_losses).distributed()
    on_ray = distributed(**settings, cluster="ray")(ddp_losses).distributed()
    assert local[0] == local[-1] and on_ray[0] == on_ray[-1]  # every rank has the same mean
    assert on_ray[0] == pytest.approx(local[0], rel=1e-5, abs=1e-6)
    assert on_ray[0][-1] < on_ray[0][0]  # it learned
