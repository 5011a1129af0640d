"""transformers' Trainer logging to MLflow as its docs say (``report_to="mlflow"``), 2 CPU ranks."""

import torch
from transformers import Trainer, TrainingArguments
from transformers_trainer import Regressor  # the model of the weights test, beside this file


def main():
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    data = [{"x": x[i], "labels": x[i].sum(0, keepdim=True)} for i in range(32)]
    args = TrainingArguments(
        output_dir="out-transformers",
        per_device_train_batch_size=8,
        num_train_epochs=1,
        learning_rate=0.05,
        report_to="mlflow",
        logging_strategy="steps",
        logging_steps=1,
        use_cpu=True,
        save_strategy="no",
        optim="sgd",
        remove_unused_columns=False,
        disable_tqdm=True,
    )
    Trainer(model=Regressor(), args=args, train_dataset=data).train()


if __name__ == "__main__":
    main()
