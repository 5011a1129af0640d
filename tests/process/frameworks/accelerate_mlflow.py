"""Accelerate's MLflow tracker as its docs say (``log_with="mlflow"``, ``init_trackers``, ``log``,
``end_training``), 2 CPU ranks."""

import torch
from accelerate import Accelerator


def main():
    accelerator = Accelerator(log_with="mlflow")
    accelerator.init_trackers("accelerate-project", config={"lr": 0.05})
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    for step in range(3):
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.item()}, step=step)
    accelerator.end_training()


if __name__ == "__main__":
    main()
