"""DDP training throughput: the same model and loop under air_magic and under torchrun, same run.

    python benchmarks/ddp_throughput.py [--steps 30] [--ranks N]

The model: 8 blocks of Linear 4096->16384->4096 (GELU, residual), bf16 autocast,
batch 64 x 256 tokens per rank, AdamW. Each launcher runs warm-up steps, then
``--steps`` timed steps; samples/s is measured inside rank 0 between two
barriers, so it is the training loop's speed, not the launch. Needs GPUs (NCCL);
on a CPU machine it runs a tiny version with gloo to check the script works.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def train(steps: int, tiny: bool) -> float:
    import os
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    cuda = torch.cuda.is_available() and not tiny
    local = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    width, hidden, blocks, batch, tokens = (4096, 16384, 8, 64, 256) if not tiny else (64, 128, 2, 4, 8)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(width, hidden)
            self.down = torch.nn.Linear(hidden, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block() for _ in range(blocks)]).to(device)
    model = DDP(model, device_ids=[local] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, tokens, width, device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    took = time.perf_counter() - start
    dist.destroy_process_group()
    return steps * batch * int(os.environ["WORLD_SIZE"]) / took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--ranks", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rank-script", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true", help="a small model (CPU check)")
    args = parser.parse_args()
    if args.rank_script:  # torchrun runs this
        result = train(args.steps, args.tiny)
        if os.environ["RANK"] == "0":
            print(json.dumps({"samples_per_s": result}), flush=True)
        return
    sys.path.insert(0, HERE)
    from air_magic import distributed

    fn = distributed(num_accelerators=args.ranks, display="none", tracking=False)(train)
    world = len(fn.distributed(1, args.tiny))
    am, tr = [], []
    for _ in range(args.repeats):
        am.append(fn.distributed(args.steps, args.tiny)[0])
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            os.path.abspath(__file__), "--rank-script", "--steps", str(args.steps),
        ] + (["--tiny"] if args.tiny else [])  # fmt: skip
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        tr.append(json.loads(out.strip().splitlines()[-1])["samples_per_s"])
    best_am, best_tr = max(am), max(tr)
    command = " ".join(sys.argv[1:])
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}; command: python benchmarks/ddp_throughput.py {command}")
    print("| ranks | air_magic samples/s | torchrun samples/s | ratio |")
    print("|---|---|---|---|")
    print(f"| {world} | {best_am:.1f} | {best_tr:.1f} | {best_am / best_tr:.3f} |")
    print(f"# all runs: air_magic {[round(v, 1) for v in am]}, torchrun {[round(v, 1) for v in tr]}")


if __name__ == "__main__":
    main()
