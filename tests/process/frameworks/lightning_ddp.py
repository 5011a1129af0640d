"""A Lightning Trainer with strategy="ddp" on 2 CPU ranks, seeded: rank 0 saves the final weights
to argv[1]. argv[3], when given, is the strategy; argv[2] is unused (the runners pass an output
folder)."""

import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main(out, folder=None, strategy="ddp"):
    L.seed_everything(0, verbose=False)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    model = Model()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8))
    if trainer.global_rank == 0:
        torch.save(model.layer.state_dict(), out)


if __name__ == "__main__":
    main(*sys.argv[1:])
