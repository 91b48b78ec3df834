"""MLflow tracking for real: MLflow's own client reads back what a demo run logged."""

from __future__ import annotations

import pytest

from convergent.trainrecords import read_train_records
from tests.runs.runshelpers import TINY, run_cli

mlflow = pytest.importorskip("mlflow", reason="the tracking extra (pip install convergent[tracking])")


def test_demo_run_is_in_mlflow_with_params_metrics_and_a_registered_model(demo_runs):
    run_dir = demo_runs / "b"
    uri = f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    run_id = (run_dir / "mlflow" / "run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == "8" and run.data.params["train.lr"] == "0.003"
    assert run.data.tags["convergent.code_commit"]

    # per-step metrics equal the last attempt's values in metrics.jsonl
    steps, _ = read_train_records(run_dir / "metrics.jsonl", last_attempt=True)
    want = {r.step: r.loss for r in steps}
    got = {m.step: m.value for m in client.get_metric_history(run_id, "train_step/loss")}
    assert got == pytest.approx(want) and sorted(got) == list(range(1, 9))
    assert client.get_metric_history(run_id, "val/energy_mae")
    assert "stage/train/core_s" in run.data.metrics and "screen/energy_mae" in run.data.metrics

    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "stages.json", "report", "model"} <= artifacts
    report = {a.path for a in client.list_artifacts(run_id, "report")}
    assert "report/report.md" in report and "report/loss.png" in report

    versions = client.search_model_versions("name = 'convergent-surrogate'")
    assert [v.run_id for v in versions] == [run_id]
    tags = versions[0].tags
    manifest = run_dir / "data" / "train" / "manifest.json"
    import hashlib

    assert tags["lineage.dataset_manifest_sha256"] == hashlib.sha256(manifest.read_bytes()).hexdigest()
    assert tags["lineage.code_commit"] == run.data.tags["convergent.code_commit"]
    assert tags["lineage.parent"] == "None"


def test_resumed_demo_registers_no_second_version(demo_runs):
    run_dir = demo_runs / "b"
    again = run_cli("demo", "--run-dir", str(run_dir), "--resume", *TINY, "--set", "train.steps=8",
                    "--set", "train.lr=3e-3", "--set", "tracking.mlflow=true")
    assert again.returncode == 0, again.stderr[-2000:]
    uri = f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    assert len(client.search_model_versions("name = 'convergent-surrogate'")) == 1


def test_a_restart_with_another_config_gets_a_new_mlflow_run(tmp_path):
    from convergent.config import load_config
    from convergent.tracking.store import open_tracking

    first = open_tracking(load_config(None, ["tracking.mlflow=true", "train.lr=1e-3"]), tmp_path)
    again = open_tracking(load_config(None, ["tracking.mlflow=true", "train.lr=1e-3"]), tmp_path)
    assert again.run_id == first.run_id  # the same config resumes the same MLflow run
    other = open_tracking(load_config(None, ["tracking.mlflow=true", "train.lr=2e-3"]), tmp_path)
    assert other.run_id != first.run_id
    client = other.client
    assert client.get_run(first.run_id).info.status == "FAILED"
    assert client.get_run(other.run_id).data.params["train.lr"] == "0.002"


def test_an_unusable_store_is_one_error_naming_the_uri(tmp_path):
    from convergent.config import load_config
    from convergent.errors import NotAvailableError
    from convergent.tracking.store import open_tracking

    cfg = load_config(None, ["tracking.mlflow=true", "tracking.uri=foo://nowhere"])
    with pytest.raises(NotAvailableError, match="MLflow store foo://nowhere: "):
        open_tracking(cfg, tmp_path)
