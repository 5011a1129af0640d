"""The trivial distributed job both launchers run: init, one all_reduce, destroy.

Run by torchrun as a script, and imported by launch_latency.py as a function.
"""

import os


def trivial() -> float:
    import torch
    import torch.distributed as dist

    backend = (
        "nccl" if os.environ.get("AIR_MAGIC_DEVICE", "") == "cuda" or torch.cuda.is_available() else "gloo"
    )
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    t = torch.ones(1, device="cuda" if backend == "nccl" else "cpu")
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


if __name__ == "__main__":
    trivial()
