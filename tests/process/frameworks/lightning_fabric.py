"""Lightning Fabric on 2 CPU ranks, seeded: rank 0 saves the final weights to argv[1]. argv[3], when
given, is the strategy (default "ddp"); argv[2] is unused (the runners pass an output folder)."""

import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


def train(fabric, out):
    fabric.seed_everything(0)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    net = torch.nn.Linear(4, 1)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8))
    for _ in range(2):
        for inputs, target in loader:
            loss = torch.nn.functional.mse_loss(model(inputs), target)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    if fabric.global_rank == 0:
        torch.save(net.state_dict(), out)


def main(out, folder=None, strategy="ddp"):
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch(train, out)
    torch.distributed.destroy_process_group()  # else gloo may abort at exit (seen under torchrun)


if __name__ == "__main__":
    main(*sys.argv[1:])
