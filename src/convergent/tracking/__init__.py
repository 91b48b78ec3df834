"""Experiment tracking: runs, metrics, artifacts and the model registry in MLflow.

Off by default (``tracking.mlflow: true`` turns it on; ``pip install convergent[tracking]``).
``config`` (the ``tracking`` section), ``store`` (client, experiment, the MLflow run of a
run directory), ``sink`` (per-step metrics from the trainer), ``finish`` (stage metrics,
artifacts, the registered surrogate with its lineage).
"""
