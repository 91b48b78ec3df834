"""Config of experiment tracking (``tracking`` section)."""

from __future__ import annotations

from pydantic import Field

from convergent.core.configbase import Section


class TrackingConfig(Section):
    """MLflow tracking, off by default.

    ``uri``: a tracking URI (``http://127.0.0.1:5000``, ``sqlite:///path/mlflow.db``);
    None keeps a local store in the run directory (``<run>/mlflow/mlflow.db`` with the
    artifacts beside it). ``model_name``: the registered model the trained surrogate
    becomes a version of. Per-step values are sent at each checkpoint and at the end
    (so a resumed run's replayed steps are not logged twice); ``max_pending`` caps the
    values held in between.
    """

    mlflow: bool = False
    uri: str | None = Field(None, min_length=1, max_length=2048)
    experiment: str = Field("convergent", min_length=1, max_length=256)
    model_name: str = Field("convergent-surrogate", min_length=1, max_length=256)
    register_model: bool = True
    max_pending: int = Field(200_000, ge=1, le=10_000_000)
