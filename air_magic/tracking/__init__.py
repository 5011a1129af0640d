"""Consumers that record a call: its MLflow run, the batched metric writer, the MLflow UI.

``run`` (the call's run: :class:`~air_magic.tracking.run.CallFacts`, ``TrackedRunOwner``,
``TrackedRun``) uses ``store`` (which store and experiment), ``remote`` (a remote
server's waits and health check), ``mlflow_import`` (``import mlflow`` off the caller's
thread), ``metric_writer`` and ``ui``; none of those imports ``run``.
"""
