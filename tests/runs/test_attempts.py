"""A killed training run resumed with `--resume`: the replayed step is recorded under the
next attempt, and every reader (report, runs) keeps the last attempt's values."""

from __future__ import annotations

import json

from convergent.runsdb.records import latest, read_records
from convergent.runsdb.rundir import RunDir
from convergent.runsdb.trainrecords import TrainStep, read_train_records
from tests.runs.runshelpers import run_cli


def test_resume_after_a_kill_is_the_next_attempt(tmp_path):
    from tests.train.moldataset import make_dataset

    train, val = make_dataset(tmp_path / "data", n_train=24, n_val=8)
    sets = [f"train.dataset={train}", f"train.val_dataset={val}", "model.hidden=32",
            "model.layers=2", "model.heads=4", "train.steps=6", "train.global_batch_atoms=96",
            "train.val_every=0", "checkpoint.interval=3", "metrics.reduce_every=1",
            "metrics.tensorboard=false"]
    try:
        import mlflow
    except ImportError:
        mlflow = None
    if mlflow is not None:
        sets.append("tracking.mlflow=true")
    args = ["train", "--nproc", "2", "--run-dir", str(tmp_path / "r")]
    for s in sets:
        args += ["--set", s]
    # SIGKILL rank 1 before step 5 (fault injection of the trainer, first attempt only)
    killed = run_cli(*args, env={"CONVERGENT_TRAIN_FAULT": "rank=1,step=4"})
    assert killed.returncode != 0 and "training failed" in killed.stderr
    run = RunDir(tmp_path / "r")
    first = [(r.step, r.attempt) for r in read_records(run.metrics, "train_step")]
    assert first == [(1, 0), (2, 0), (3, 0), (4, 0)]

    resumed = run_cli(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    raw = [(r.step, r.attempt) for r in read_records(run.metrics, "train_step")]
    assert raw == first + [(4, 1), (5, 1), (6, 1)]  # step 4 replayed from the step-3 checkpoint
    kept = latest(run.metrics, "train_step")
    assert [(r.step, r.attempt) for r in kept] == [(1, 0), (2, 0), (3, 0), (4, 1), (5, 1), (6, 1)]
    assert [r.attempt for r in latest(run.metrics, "val")] == [1]
    steps, vals = read_train_records(run.metrics, last_attempt=True)  # the typed reader agrees
    assert [(s.step, s.attempt) for s in steps] == [(r.step, r.attempt) for r in kept]
    assert steps == [TrainStep.from_metric(r) for r in kept] and [v.attempt for v in vals] == [1]

    shown = json.loads(run_cli("runs", "show", str(run.path), "--json").stdout)
    assert shown["metrics"]["step"] == 6 and shown["metrics"]["loss"] == steps[-1].loss
    report = run_cli("report", str(run.path))
    assert report.returncode == 0, report.stderr
    if mlflow is not None:  # MLflow holds one value per step too: the last attempt's
        uri = f"sqlite:///{run.path / 'mlflow' / 'mlflow.db'}"
        client = mlflow.MlflowClient(tracking_uri=uri)
        run_id = (run.path / "mlflow" / "run_id").read_text().strip()
        history = client.get_metric_history(run_id, "train_step/loss")
        assert sorted(m.step for m in history) == [1, 2, 3, 4, 5, 6]
        assert {m.step: m.value for m in history} == {r.step: r.loss for r in steps}
