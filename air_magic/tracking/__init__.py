"""Consumers that record a call: its MLflow run, the batched metric writer, the MLflow UI."""
