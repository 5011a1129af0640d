"""DeepSpeed's ``init_distributed`` on gloo, 2 CPU ranks: one all-reduce; mpi4py never imported
(DeepSpeed looks for MPI only when torchrun's variables are missing). Prints one JSON line."""

import json
import os
import sys

import deepspeed
import torch


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    value = torch.tensor([float(os.environ["RANK"]) + 1])
    torch.distributed.all_reduce(value)
    facts = {
        "rank": torch.distributed.get_rank(),
        "world": torch.distributed.get_world_size(),
        "sum": value.item(),
        "mpi4py": "mpi4py" in sys.modules,
    }
    print(json.dumps(facts))
    torch.distributed.destroy_process_group()  # else gloo may abort at exit (seen under torchrun)
    return facts


if __name__ == "__main__":
    main()
