"""transformers' Trainer on a model built in code (no download), 2 CPU ranks, seeded: rank 0 saves the final
weights to argv[1]; argv[2] is its output folder."""

import sys

import torch
from transformers import Trainer, TrainingArguments


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def forward(self, x, labels=None):
        out = self.layer(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def main(out, folder):
    torch.manual_seed(0)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    data = [{"x": x[i], "labels": x[i].sum(0, keepdim=True)} for i in range(64)]
    model = Regressor()
    args = TrainingArguments(
        output_dir=folder,
        per_device_train_batch_size=8,
        num_train_epochs=2,
        learning_rate=0.05,
        seed=0,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        optim="sgd",
        lr_scheduler_type="constant",
        remove_unused_columns=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    if trainer.is_world_process_zero():
        torch.save(model.layer.state_dict(), out)
    torch.distributed.destroy_process_group()  # else gloo may abort at exit (seen under torchrun)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
