# %% [markdown]
# # DeepSpeed ZeRO (stage 2 or 3) from a notebook cell
#
# Plain DeepSpeed code: `deepspeed.initialize` wraps a residual MLP classifier
# with ZeRO stage 2 (optimizer state and gradients sharded) or stage 3 (parameters
# too), bf16 on GPUs. The task is synthetic: 32 classes, each a direction in input
# space, plus noise. Returns rank 0's loss every few steps. DeepSpeed needs GPUs
# here (NCCL); install it with `DS_BUILD_OPS=0 pip install deepspeed` (ops build
# on first use, kept in `TORCH_EXTENSIONS_DIR`).

# %%
from air_magic import distributed


# %%
@distributed()
def train_zero(stage: int = 2, steps: int = 150, batch_size: int = 64, width: int = 1024, depth: int = 6):
    import os

    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    classes, features = 32, 256

    gen = torch.Generator().manual_seed(3)
    directions = torch.randn(classes, features, generator=gen)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1_000_000 * rank + step)  # each rank its own data
        labels = torch.randint(0, classes, (batch_size,), generator=g)
        x = directions[labels] + 2.0 * torch.randn(batch_size, features, generator=g)
        return x.cuda().to(torch.bfloat16), labels.cuda()

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(features, width), *[Block() for _ in range(depth)], nn.Linear(width, classes)
    )
    config = {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,  # plain torch AdamW: no DeepSpeed op to compile
        "steps_per_print": 1_000_000,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = nn.functional.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        if step % 10 == 0 or step == steps - 1:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(round(mean.item() / world, 5))
            if rank == 0:
                print(f"ZeRO-{stage} step {step}: loss {losses[-1]:.4f}")
    parameters = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    dist.destroy_process_group()
    return {"losses": losses, "parameters": parameters, "samples": steps * batch_size * world}


# %%
if __name__ == "__main__":
    for stage in (2, 3):
        result = train_zero.distributed(stage=stage)[0]
        first, last = result["losses"][0], result["losses"][-1]
        print(f"ZeRO-{stage}: {result['parameters']:,} parameters, loss {first} -> {last}")
