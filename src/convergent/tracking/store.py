"""The MLflow side of a run directory: client, experiment and the one MLflow run.

Every launch that tracks a run directory (the demo process, the trainer's rank 0, a
resumed run) finds the same MLflow run through ``<run>/mlflow/run_id``; the first one
creates it and logs the resolved config as params and the code version as tags. A run
directory restarted with another config (its first start failed) gets a new MLflow run.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convergent.core.errors import NotAvailableError
from convergent.core.fsutil import atomic_write_text
from convergent.core.provenance import code_version

STORE_DIR = "mlflow"
RUN_ID_FILE = "run_id"
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value
CONFIG_TAG = "convergent.config_sha256"  # the resolved config this MLflow run logged


def import_mlflow() -> Any:
    try:
        import mlflow
    except ImportError:
        raise NotAvailableError(
            "tracking.mlflow is on but MLflow is not installed",
            hint="pip install 'convergent[tracking]' (or set tracking.mlflow=false)",
        ) from None
    return mlflow


def store_uri(tracking: Any, run_path: Path) -> str:
    """``tracking.uri``, else the sqlite store ``<run>/mlflow/mlflow.db``."""
    if tracking.uri:
        return str(tracking.uri)
    return f"sqlite:///{(run_path / STORE_DIR / 'mlflow.db').resolve()}"


@dataclass
class Tracked:
    """An open MLflow client and the run of one run directory."""

    client: Any
    run_id: str
    uri: str


def _flat_params(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat_params(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)[:MAX_PARAM_CHARS]
    return out


def _experiment(client: Any, tracking: Any, run_path: Path, local: bool) -> str:
    exp = client.get_experiment_by_name(tracking.experiment)
    if exp is not None:
        return exp.experiment_id
    where = (run_path / STORE_DIR / "artifacts").resolve().as_uri() if local else None
    return client.create_experiment(tracking.experiment, artifact_location=where)


def _config_hash(cfg: Any, run_path: Path) -> str:
    """sha256 of the run directory's ``config.yaml`` (what the demo and its training job
    share, though the job's own config names the datasets), else of ``cfg``."""
    config = run_path / "config.yaml"
    data = config.read_bytes() if config.is_file() else cfg.model_dump_json().encode()
    return hashlib.sha256(data).hexdigest()


def open_tracking(cfg: Any, run_path: str | Path) -> Tracked:
    """The MLflow run of ``run_path`` (created, with params and tags, on first use).

    An unusable store (a wrong ``tracking.uri``, a server that refuses) is one
    :class:`~convergent.core.errors.NotAvailableError` naming the URI."""
    mlflow = import_mlflow()
    from mlflow.exceptions import MlflowException

    logging.getLogger("mlflow").setLevel(logging.WARNING)  # no INFO lines about DB set-up
    uri = store_uri(cfg.tracking, Path(run_path))
    try:
        return _open(mlflow, cfg, Path(run_path))
    except (MlflowException, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise NotAvailableError(
            f"MLflow store {uri}: {first}",
            hint="check tracking.uri (unset: a sqlite store in the run directory)",
        ) from exc


def _open(mlflow: Any, cfg: Any, run_path: Path) -> Tracked:
    from mlflow.entities import Param, RunTag
    from mlflow.exceptions import MlflowException

    tracking = cfg.tracking
    local = not tracking.uri
    if local:
        (run_path / STORE_DIR).mkdir(parents=True, exist_ok=True)
    uri = store_uri(tracking, run_path)
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    id_file = run_path / STORE_DIR / RUN_ID_FILE
    config_hash = _config_hash(cfg, run_path)
    if id_file.exists():
        run_id = id_file.read_text(encoding="utf-8").strip()
        try:
            previous = client.get_run(run_id)
        except MlflowException:
            previous = None  # deleted in MLflow, or another store: start a new MLflow run
        if previous is not None and previous.data.tags.get(CONFIG_TAG) == config_hash:
            client.update_run(run_id, status="RUNNING")  # the same run, resumed
            return Tracked(client, run_id, uri)
        if previous is not None:  # the run directory was restarted with another config
            client.set_terminated(run_id, status="FAILED")
    exp_id = _experiment(client, tracking, run_path, local)
    code = code_version()
    tags = {"convergent.run_dir": str(run_path.resolve()), "convergent.code_commit": code.commit,
            "convergent.code_dirty": str(code.dirty), "mlflow.runName": run_path.name,
            "mlflow.source.git.commit": code.commit, CONFIG_TAG: config_hash}
    run = client.create_run(exp_id, run_name=run_path.name, tags=tags)
    run_id = run.info.run_id
    params = [Param(k, v) for k, v in _flat_params(cfg.model_dump(mode="json")).items()]
    for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
        client.log_batch(run_id, params=params[i : i + 100])
    client.log_batch(run_id, tags=[RunTag("convergent.code_version", code.short)])
    id_file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(id_file, run_id + "\n")
    return Tracked(client, run_id, uri)
