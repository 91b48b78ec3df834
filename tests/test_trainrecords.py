"""The typed train_step / val records read and write the metrics.jsonl lines unchanged."""

from __future__ import annotations

import json

from convergent.runsdb.records import latest
from convergent.runsdb.rundir import RunDir
from convergent.runsdb.trainrecords import TIME_PARTS, TrainStep, ValRecord, read_train_records
from convergent.train.command import progress_line

# a train_step line as the trainer wrote it before the typed records (molecular task)
OLD_STEP = {
    "time": 1700000000.5, "kind": "train_step", "step": 3, "loss": 0.25, "energy_mae": 0.4,
    "energy_mae_per_atom": 0.05, "force_mae": 0.3, "lr": 1e-3, "grad_norm": 2.5,
    "start_time": 1700000000.0, "peak_mem_bytes": 1234, "comm_bytes": None,
    "strategy": "single", "world": 1, "attempt": 1, "data_wait_s": 0.01, "compute_s": 0.2,
    "comm_s": 0.0, "optimizer_s": 0.02, "step_s": 0.23, "samples_per_s": 40.0,
    "atoms_per_s": 400.0, "mfu": None, "peak_flops": 1e11, "peak_source": "measured",
}


def test_an_old_line_reads_typed_and_writes_back_the_same_keys_and_values():
    rec = TrainStep.from_dict(OLD_STEP)
    assert (rec.step, rec.attempt, rec.unit, rec.units_per_s) == (3, 1, "atoms", 400.0)
    assert rec.times() == {k: OLD_STEP[k] for k in TIME_PARTS}
    assert rec.metrics() == {"loss": 0.25, "energy_mae": 0.4, "energy_mae_per_atom": 0.05,
                             "force_mae": 0.3}
    assert rec.extra == {}
    assert rec.to_dict() == {k: v for k, v in OLD_STEP.items()}


def test_language_model_units_unknown_keys_and_missing_fields():
    row = {"kind": "train_step", "step": 1, "loss": 5.0, "perplexity": 148.4,
           "tokens_per_s": 900.0, "loss_scale": 1024.0, "new_field": [1, 2]}
    rec = TrainStep.from_dict(row)
    assert (rec.unit, rec.units_per_s, rec.loss_scale) == ("tokens", 900.0, 1024.0)
    assert rec.extra == {"new_field": [1, 2]}  # kept, and written back
    assert rec.compute_s is None and rec.times() is None  # an older line without times
    out = rec.to_dict()
    assert out["tokens_per_s"] == 900.0 and "atoms_per_s" not in out
    assert out["new_field"] == [1, 2] and out["perplexity"] == 148.4
    assert "energy_mae" not in out  # a task metric the LM does not have is left out
    assert out["mfu"] is None  # a measured field that is unknown is written as null


def test_val_record_round_trip_and_task_metrics():
    val = ValRecord(step=20, attempt=2)
    val.set_metrics({"loss": 0.1, "force_mae": 0.2, "something_new": 7.0})
    out = val.to_dict()
    assert out == {"kind": "val", "loss": 0.1, "force_mae": 0.2, "step": 20, "attempt": 2,
                   "something_new": 7.0}
    assert ValRecord.from_dict(json.loads(json.dumps(out))) == val


def test_records_read_back_from_a_run_directory(tmp_path):
    run = RunDir(tmp_path / "r")
    run.path.mkdir()
    run.log_metrics(TrainStep.from_dict(OLD_STEP).to_dict())
    run.log_metrics(ValRecord(step=3, loss=0.5, energy_mae=0.4).to_dict())
    (step,) = [TrainStep.from_metric(m) for m in latest(run.metrics, "train_step")]
    (val,) = [ValRecord.from_metric(m) for m in latest(run.metrics, "val")]
    assert step.units_per_s == 400.0 and step.attempt == 1 and step.time is not None
    assert (val.step, val.loss, val.energy_mae, val.force_mae) == (3, 0.5, 0.4, None)


def test_read_train_records_types_steps_and_vals_and_keeps_the_last_attempt(tmp_path):
    run = RunDir(tmp_path / "r")
    run.path.mkdir()
    for row in ({"kind": "placement", "nproc": 2},
                {"kind": "train_step", "step": 1, "attempt": 0, "loss": 5.0},
                {"kind": "train_step", "step": 2, "attempt": 0, "loss": 4.0},  # replayed
                {"kind": "val", "step": 2, "attempt": 0, "loss": 9.0},
                {"kind": "train_step", "step": 2, "attempt": 1, "loss": 3.5},
                {"kind": "train_step", "step": 3, "attempt": 1, "loss": 3.0}):
        run.log_metrics(row)
    steps, vals = read_train_records(run.metrics)
    assert [(s.step, s.attempt, s.loss) for s in steps] == \
        [(1, 0, 5.0), (2, 0, 4.0), (2, 1, 3.5), (3, 1, 3.0)]
    assert [(v.step, v.loss) for v in vals] == [(2, 9.0)] and isinstance(vals[0], ValRecord)
    last, _ = read_train_records(run.metrics, last_attempt=True)
    assert [(s.step, s.loss) for s in last] == [(1, 5.0), (2, 3.5), (3, 3.0)]
    assert read_train_records(tmp_path / "missing.jsonl") == ([], [])


def test_progress_lines():
    assert progress_line(OLD_STEP, steps=3, log_every=10) == \
        "step 3/3 loss 0.25 atoms/s 400 mfu n/a"
    assert progress_line({**OLD_STEP, "step": 2}, steps=3, log_every=10) is None
    assert progress_line({"kind": "val", "step": 3, "loss": 0.125}, 3, 10) == \
        "  val step 3: loss 0.125"
