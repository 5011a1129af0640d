# %% [markdown]
# # FSDP2: a small transformer language model, sharded with `fully_shard`
#
# Plain PyTorch FSDP2 code: a 4-layer decoder-only transformer learns to predict
# the next token of sequences drawn from a fixed random Markov chain (so the loss
# has a known floor: the chain's entropy). Every layer, then the whole model, is
# sharded across the ranks with `torch.distributed.fsdp.fully_shard`; on GPUs the
# parameters compute in bf16 and gradients reduce in fp32. Returns rank 0's loss
# every few steps and the chain's entropy. NCCL on GPUs, gloo on 2 CPU ranks.

# %%
from air_magic import distributed


# %%
@distributed()
def train_lm(steps: int = 200, batch_size: int = 32, seq_len: int = 128, layers: int = 4, width: int = 256):
    import math
    import os

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    local_rank = int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab = 256

    # The task: a Markov chain with sharp transitions; the same chain on every rank.
    gen = torch.Generator().manual_seed(7)
    transitions = torch.softmax(3.0 * torch.randn(vocab, vocab, generator=gen), dim=1)
    entropy = -(transitions * transitions.log()).sum(1).mean().item()

    def batch(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1_000_000 * rank + step)  # each rank its own data
        tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch_size,), generator=g)
        for t in range(seq_len):
            tokens[:, t + 1] = torch.multinomial(transitions[tokens[:, t]], 1, generator=g).squeeze(1)
        return tokens.to(device)

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.pos = nn.Parameter(torch.randn(seq_len, width) * 0.02)
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(
                    width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=True
                )
                for _ in range(layers)
            )
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens) + self.pos[: tokens.shape[1]]
            mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
            for layer in self.layers:
                x = layer(x, src_mask=mask, is_causal=True)
            return self.head(self.norm(x).flatten(0, 1))  # (batch*seq, vocab): a new tensor, not a view

    torch.manual_seed(0)  # the same initial weights everywhere before sharding
    model = LM().to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else None
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy) if policy else fully_shard(layer)
    fully_shard(model, mp_policy=policy) if policy else fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    losses = []
    for step in range(steps):
        tokens = batch(step)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float(), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == steps - 1:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(round(mean.item() / world, 5))
            if rank == 0:
                print(
                    f"step {step}: loss {losses[-1]:.4f} (floor {entropy:.4f}, uniform {math.log(vocab):.4f})"
                )
    dist.destroy_process_group()
    return {"losses": losses, "entropy": entropy, "tokens": steps * batch_size * seq_len * world}


# %%
if __name__ == "__main__":
    result = train_lm.distributed()[0]
    print(f"final loss {result['losses'][-1]:.4f}, floor {result['entropy']:.4f}")
