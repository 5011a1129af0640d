# %% [markdown]
# # DDP: a small CNN with a progress bar on every rank
#
# Plain PyTorch DDP code: a small convolutional classifier learns a synthetic
# 10-class image task (each class has its own pattern, plus noise). Every rank
# shows a `tqdm` bar in its own tab; the function returns each epoch's mean loss
# and the final accuracy, so the cell gets every rank's numbers back. Runs on
# every GPU with NCCL, or on 2 CPU ranks with gloo when there is no GPU.

# %%
from air_magic import distributed


# %%
@distributed()
def train_cnn(epochs: int = 3, batch_size: int = 128, samples: int = 20_000, lr: float = 2e-3):
    import os

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    from tqdm.auto import tqdm

    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()

    # Data: the same on every rank (fixed generator); the sampler gives each rank its share.
    gen = torch.Generator().manual_seed(1234)
    patterns = torch.randn(10, 3, 32, 32, generator=gen)
    labels = torch.randint(0, 10, (samples,), generator=gen)
    images = patterns[labels] + 1.5 * torch.randn(samples, 3, 32, 32, generator=gen)
    data = TensorDataset(images, labels)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=True)

    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(128, 10),
    ).to(device)  # fmt: skip
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()

    epoch_losses = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        total = torch.zeros((), device=device)
        bar = tqdm(loader, desc=f"rank {rank} epoch {epoch}", mininterval=0.5)
        for xb, yb in bar:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(xb), yb)
            loss.backward()
            optimizer.step()
            total += loss.detach()
        epoch_losses.append(total.item() / len(loader))
        print(f"rank {rank} epoch {epoch}: mean loss {epoch_losses[-1]:.4f}")

    model.eval()
    correct = torch.zeros((), device=device)
    with torch.no_grad():
        for xb, yb in loader:
            correct += (model(xb.to(device)).argmax(1) == yb.to(device)).sum()
    dist.all_reduce(correct)
    accuracy = correct.item() / (len(loader) * batch_size * dist.get_world_size())
    dist.destroy_process_group()
    return {"epoch_losses": epoch_losses, "accuracy": accuracy}


# %%
if __name__ == "__main__":
    results = train_cnn.distributed()
    for rank, result in enumerate(results):
        print(f"rank {rank}: losses {[round(x, 4) for x in result['epoch_losses']]}, "
              f"accuracy {result['accuracy']:.3f}")  # fmt: skip
