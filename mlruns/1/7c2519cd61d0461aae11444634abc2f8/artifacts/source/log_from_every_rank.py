def _log_from_every_rank(steps):
    import os

    import mlflow

    rank = int(os.environ["RANK"])
    shared = os.environ["MLFLOW_RUN_ID"]  # (mlflow.start_run() removes it from the environment)
    with mlflow.start_run():  # a user's own start/end (resumes the shared run) must not end it
        mlflow.log_param(f"rank{rank}_param", "yes")
    for step in range(steps):
        mlflow.log_metric("loss", 1.0 / (step + 1) + rank, step=step)
        mlflow.log_metric(f"rank{rank}_seen", step, step=step)
    mlflow.end_run()
    mlflow.log_metric(f"rank{rank}_after_end", 1.0)  # still lands in the shared run
    assert mlflow.active_run().info.run_id == shared
    return shared
