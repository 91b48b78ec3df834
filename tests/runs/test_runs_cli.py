"""`convergent runs list|show|compare|cost|rm` on real demo runs, and the record rules."""

from __future__ import annotations

import json
import shutil

import pytest

from convergent.runsdb.cost import ACCOUNTING_FILE, run_cost
from convergent.runsdb.records import CostRecord, MetricRecord, last_attempts, next_attempt
from convergent.runsdb.rundir import RunDir
from convergent.runsdb.trainrecords import read_train_records
from tests.runs.runshelpers import TINY, run_cli


def test_last_attempt_wins_for_a_replayed_step(tmp_path):
    rows = [
        {"kind": "train_step", "step": 1, "attempt": 0, "loss": 5.0},
        {"kind": "train_step", "step": 2, "attempt": 0, "loss": 4.0},  # replayed below
        {"kind": "val", "step": 2, "attempt": 0, "loss": 9.0},
        {"kind": "train_step", "step": 2, "attempt": 1, "loss": 3.5},
        {"kind": "train_step", "step": 3, "attempt": 1, "loss": 3.0},
        {"kind": "stage", "stage": "train", "wall_s": 1.0},
    ]
    kept = last_attempts([MetricRecord.from_dict(r) for r in rows])
    steps = [(r.step, r.get("loss")) for r in kept if r.kind == "train_step"]
    assert steps == [(1, 5.0), (2, 3.5), (3, 3.0)]
    assert [r.get("loss") for r in kept if r.kind == "val"] == [9.0]
    assert [r.get("stage") for r in kept if r.kind == "stage"] == ["train"]
    metrics = tmp_path / "metrics.jsonl"
    assert next_attempt(metrics) == 0
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert next_attempt(metrics) == 2


def test_list_show_and_json(demo_runs):
    out = run_cli("runs", "list", "--root", str(demo_runs), "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert set(rows) == {"a", "b"}
    for r in rows.values():
        assert list(r["stages"]) == ["simulate", "data", "train", "screen", "md_check", "learn"]
        assert set(r["stages"].values()) == {"done"}
        assert r["size_bytes"] > 0 and r["duration_s"] > 0 and r["start"] > 0
        assert r["code"] != "" and "val_energy_mae" in r["metrics"]
    assert rows["a"]["metrics"]["step"] == 6 and rows["b"]["metrics"]["step"] == 8
    # the code version is in every stage record, checkpoint marker and exported model
    from convergent.core.provenance import code_version

    here = code_version().to_dict()
    stages = json.loads((demo_runs / "a" / "stages.json").read_text())
    assert all(s["code"] == here for s in stages.values())
    markers = list((demo_runs / "a" / "ckpt").glob("step_*/COMPLETE"))
    assert markers and all(json.loads(m.read_text())["code"] == here for m in markers)
    meta = json.loads((demo_runs / "a" / "ckpt" / "final" / "model_config.json").read_text())
    assert meta["code"] == here
    table = run_cli("runs", "list", "--root", str(demo_runs))
    assert table.returncode == 0 and table.stdout.splitlines()[0].split()[:3] == [
        "NAME", "STAGES", "START"]
    show = run_cli("runs", "show", "a", "--root", str(demo_runs))
    assert show.returncode == 0 and "simulate data train screen" in show.stdout
    missing = run_cli("runs", "show", "nope", "--root", str(demo_runs))
    assert missing.returncode == 2 and missing.stderr.startswith("error: no run named 'nope'")


def test_compare_prints_the_config_diff_metrics_and_writes_the_plot(demo_runs, tmp_path):
    png = tmp_path / "cmp.png"
    out = run_cli("runs", "compare", "a", "b", "--root", str(demo_runs), "--plot", str(png))
    assert out.returncode == 0, out.stderr
    diff_lines = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()
                  if line.startswith(("train.", "tracking."))}
    assert diff_lines["train.lr"] == ["0.001", "0.003"]
    assert diff_lines["train.steps"] == ["6", "8"]
    assert "train.batch_atoms" not in diff_lines  # equal keys are not shown
    assert "val_energy_mae" in out.stdout and "core_s" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    js = json.loads(run_cli("runs", "compare", "a", "b", "--root", str(demo_runs),
                            "--plot", str(png), "--json").stdout)
    assert js["metrics"]["step"] == [6, 8]
    assert len(js["code"]) == 2 and "unknown" not in js["code"]


def test_cost_sums_match_the_stage_timings(demo_runs):
    out = run_cli("runs", "cost", "a", "b", "--root", str(demo_runs), "--json")
    assert out.returncode == 0, out.stderr
    for cost in json.loads(out.stdout):
        stages = json.loads((demo_runs / cost["run"] / "stages.json").read_text())
        by_stage = {s["stage"]: s for s in cost["stages"]}
        assert set(by_stage) == set(stages)
        for name, s in stages.items():
            assert by_stage[name]["wall_s"] == s["wall_s"]
            assert by_stage[name]["core_s"] == s["wall_s"] * s["cores"]
        assert abs(cost["total"]["wall_s"] - sum(s["wall_s"] for s in stages.values())) < 1e-9
        assert abs(cost["total"]["core_s"] - sum(s["wall_s"] * s["cores"]
                                                 for s in stages.values())) < 1e-9
        assert stages["train"]["cores"] == 2  # 2 torchrun processes x 1 thread
    table = run_cli("runs", "cost", "--root", str(demo_runs))
    assert table.returncode == 0 and "total" in table.stdout


def test_scheduler_records_replace_a_stages_own_timing(demo_runs, tmp_path):
    copy = tmp_path / "a"
    shutil.copytree(demo_runs / "a", copy)
    billed = CostRecord(stage="train", wall_s=20.0, core_s=80.0, gpu_s=40.0, cores=4, gpus=2,
                        source="slurm", job_id="123")
    own = {"stage": "train", "source": "self", "core_s": 7.0, "detail": {"x": 1}}  # skipped
    lines = [json.dumps({**billed.to_dict(), "detail": {"via": "sacct"}}), json.dumps(own), "{torn"]
    (copy / ACCOUNTING_FILE).write_text("\n".join(lines))
    cost = run_cost(RunDir(copy))
    train = cost.by_stage()["train"]
    assert (train.source, train.core_s, train.gpu_s, train.job_id) == ("slurm", 80.0, 40.0, "123")
    stages = json.loads((copy / "stages.json").read_text())
    others = sum(s["wall_s"] * s["cores"] for k, s in stages.items() if k != "train")
    assert abs(cost.total()["core_s"] - (others + 80.0)) < 1e-9


def test_rm_asks_then_removes(demo_runs, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(demo_runs / "a", root / "x")
    kept = run_cli("runs", "rm", "x", "--root", str(root), stdin="n\n")
    assert kept.returncode == 0 and (root / "x" / "config.yaml").exists()
    gone = run_cli("runs", "rm", "x", "--root", str(root), "--yes")
    assert gone.returncode == 0 and not (root / "x").exists()
    (root / "precious").mkdir()
    (root / "precious" / "f.txt").write_text("keep")
    refused = run_cli("runs", "rm", "precious", "--root", str(root), "--yes")
    assert refused.returncode == 2 and (root / "precious" / "f.txt").read_text() == "keep"


def test_a_resumed_stage_adds_its_launches_and_held_resources(tmp_path):
    from convergent.config import load_config
    from convergent.runsdb.rundir import open_run
    from convergent.runsdb.usage import allocation, record_stage, timed_stage

    cfg = load_config(None, ["parallel.nproc=3", "train.threads=2", "train.device=cpu",
                             "cluster.n_workers=4"])
    assert allocation(cfg, "train") == (6.0, 0.0)
    from convergent.cluster.placement import Placement

    assert allocation(cfg, "train", Placement("cpu", 1, "gloo", 0)) == (2.0, 0.0)
    assert allocation(cfg, "train", Placement("cuda", 4, "nccl", 4)) == (8.0, 4.0)
    auto = load_config(None, ["parallel.nproc=auto", "train.device=cpu"])
    assert allocation(auto, "train") == (2.0, 0.0)  # auto: 2 CPU processes x 1 thread
    assert allocation(cfg, "simulate") == (4.0, 0.0)
    from convergent.monitor.comparison import peer_stage

    assert allocation(cfg, peer_stage("mace")) == (6.0, 0.0)  # a demo peer trains as ours
    run = open_run(cfg, tmp_path / "r")
    first = timed_stage(cfg, "train", lambda: {"steps": 3})
    record_stage(run, "train", first)
    second = timed_stage(cfg, "train", lambda: {"steps": 5})
    record_stage(run, "train", second)
    rec = run.stages()["train"]
    assert rec["steps"] == 5 and rec["launches"] == 2 and rec["cores"] == 6.0
    assert rec["wall_s"] == first["wall_s"] + second["wall_s"]
    cost = run_cost(run).by_stage()["train"]
    assert cost.core_s == rec["wall_s"] * 6.0


# ------------------------------------------------------------------ MLflow (demo run b)


def test_demo_run_is_in_mlflow_with_params_metrics_and_a_registered_model(demo_runs):
    mlflow = pytest.importorskip("mlflow", reason="the tracking extra (pip install convergent[tracking])")
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
    mlflow = pytest.importorskip("mlflow", reason="the tracking extra (pip install convergent[tracking])")
    run_dir = demo_runs / "b"
    again = run_cli("demo", "--run-dir", str(run_dir), "--resume", *TINY, "--set", "train.steps=8",
                    "--set", "train.lr=3e-3", "--set", "tracking.mlflow=true")
    assert again.returncode == 0, again.stderr[-2000:]
    uri = f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    assert len(client.search_model_versions("name = 'convergent-surrogate'")) == 1
