"""A Lightning Trainer with ``MLFlowLogger()`` as Lightning's docs show it, 2 CPU ranks; argv[1], when
given, is the logger's ``experiment_name`` (then the logger asks for a run of its own)."""

import sys

import lightning as L
import torch
from lightning.pytorch.loggers import MLFlowLogger
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self, lr=0.05):
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, index):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def main(experiment=None):
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    logger = MLFlowLogger(experiment_name=experiment) if experiment else MLFlowLogger()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        logger=logger,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8))


if __name__ == "__main__":
    main(*sys.argv[1:])
