"""Quick start: a small DDP training on every GPU of this machine (or 2 CPU ranks without one).

Run it with ``./scripts/quickstart.sh`` (sets everything up first) or, in a
ready environment, ``python examples/quickstart.py``. The same function
works pasted into a notebook cell.
"""

from air_magic import distributed


@distributed()
def train(epochs: int = 5, batch_size: int = 64, lr: float = 3e-3):
    import os

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import air_magic

    device = air_magic.init_process_group()  # nccl + cuda:LOCAL_RANK on GPUs, gloo on the CPU
    rank, world = dist.get_rank(), dist.get_world_size()

    # A learnable toy problem: y = sum of the inputs' squares, plus noise. Same data on every rank.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=gen)
    y = (x**2).sum(dim=1, keepdim=True) + 0.1 * torch.randn(4096, 1, generator=gen)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)

    torch.manual_seed(0)  # identical initial weights on every rank (DDP also broadcasts them)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 1),
    ).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = torch.nn.MSELoss()

    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
        mean = torch.tensor([total / batches], device=device)
        dist.all_reduce(mean)
        if rank == 0:
            print(f"epoch {epoch + 1}/{epochs}: mean loss {mean.item() / world:.3f}")

    # DDP keeps replicas identical: every rank returns the same checksum.
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    dist.destroy_process_group()
    return {"rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]), "checksum": round(checksum, 6)}


if __name__ == "__main__":
    results = train.distributed(epochs=5)
    for r in results:
        print(r)
    assert len({r["checksum"] for r in results}) == 1, "replicas diverged"
    print(f"OK: {len(results)} ranks trained one model")
