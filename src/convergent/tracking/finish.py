"""The end of a tracked run: stage metrics, artifacts and the registered surrogate.

:func:`finish_run` logs each stage's wall/core seconds and the screening errors, uploads
the config, ``stages.json`` and the report (markdown and plots), and registers
``ckpt/final`` as a new version of ``tracking.model_name`` whose tags carry its lineage:
the training dataset's manifest hash, the parent checkpoint it was fine-tuned from (if
any) and the code version. It is idempotent per run: re-running it after a resume logs
a new model version only when the weights changed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convergent.runsdb.cost import run_cost
from convergent.runsdb.records import read_records
from convergent.runsdb.rundir import RunDir
from convergent.tracking.store import Tracked, open_tracking

MODEL_ARTIFACT = "model"


@dataclass(frozen=True)
class Lineage:
    """Where a registered model came from."""

    dataset: str | None
    dataset_manifest_sha256: str | None
    parent: str | None  # checkpoint it was fine-tuned from
    code_commit: str
    code_dirty: bool | None
    weights_sha256: str

    def tags(self) -> dict[str, str]:
        return {f"lineage.{k}": str(v) for k, v in self.__dict__.items()}


def _sha256(path: Path) -> str | None:
    if not path.is_file():
        return None
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def lineage(cfg: Any, model_dir: Path) -> Lineage:
    """The lineage of the exported model in ``model_dir`` trained under ``cfg``."""
    meta: dict[str, Any] = {}
    for name in ("model_config.json", "config.json"):
        if (model_dir / name).is_file():
            meta = json.loads((model_dir / name).read_text(encoding="utf-8"))
            break
    code = meta.get("code") or meta.get("convergent_code") or {}
    extra = meta.get("extra") or {}
    dataset = extra.get("dataset") or cfg.train.dataset  # the export names what it trained on
    weights = next(iter(sorted(model_dir.glob("*.safetensors"))), model_dir / "model.safetensors")
    return Lineage(
        dataset=dataset,
        dataset_manifest_sha256=_sha256(Path(dataset) / "manifest.json") if dataset else None,
        parent=extra.get("parent"),
        code_commit=str(code.get("commit", "unknown")),
        code_dirty=code.get("dirty"),
        weights_sha256=_sha256(weights) or "missing",
    )


def _stage_metrics(t: Tracked, run: RunDir) -> None:
    from mlflow.entities import Metric

    cost = run_cost(run)
    now = 0
    metrics = []
    for st in cost.by_stage().values():
        metrics += [Metric(f"stage/{st.stage}/wall_s", st.wall_s, now, 0),
                    Metric(f"stage/{st.stage}/core_s", st.core_s, now, 0)]
        if st.gpu_s:
            metrics.append(Metric(f"stage/{st.stage}/gpu_s", st.gpu_s, now, 0))
    screens = read_records(run.metrics, "screen")
    if screens:
        for k, v in screens[-1].values.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                metrics.append(Metric(f"screen/{k}", float(v), now, 0))
    if metrics:
        t.client.log_batch(t.run_id, metrics=metrics)


def _register(t: Tracked, cfg: Any, model_dir: Path, run_name: str) -> str | None:
    """A new model version for ``model_dir`` unless this run already registered these
    weights; returns the version."""
    lin = lineage(cfg, model_dir)
    name = cfg.tracking.model_name
    client = t.client
    if not client.search_registered_models(filter_string=f"name = '{name}'"):
        client.create_registered_model(name, description="convergent molecular surrogate")
    for mv in client.search_model_versions(f"name = '{name}' and run_id = '{t.run_id}'"):
        if mv.tags.get("lineage.weights_sha256") == lin.weights_sha256:
            return str(mv.version)
    client.log_artifacts(t.run_id, str(model_dir), MODEL_ARTIFACT)
    source = f"{client.get_run(t.run_id).info.artifact_uri}/{MODEL_ARTIFACT}"
    for k, v in lin.tags().items():
        client.set_tag(t.run_id, k, v)
    mv = client.create_model_version(name, source=source, run_id=t.run_id, tags=lin.tags(),
                                     description=f"trained in convergent run {run_name}")
    return str(mv.version)


def finish_run(cfg: Any, run_dir: str | Path, status: str = "FINISHED") -> dict[str, Any]:
    """Log the run's stage metrics, artifacts and model; mark the MLflow run ``status``."""
    run = RunDir(Path(run_dir))
    t = open_tracking(cfg, run.path)
    _stage_metrics(t, run)
    for f in (run.config, run.stages_file):
        if f.is_file():
            t.client.log_artifact(t.run_id, str(f))
    if (run.report / "report.md").is_file():
        t.client.log_artifacts(t.run_id, str(run.report), "report")
    version = None
    final = run.ckpt / "final"
    if cfg.tracking.register_model and final.is_dir():
        version = _register(t, cfg, final, run.path.name)
    t.client.set_terminated(t.run_id, status=status)
    return {"uri": t.uri, "run_id": t.run_id, "model_version": version}
