"""The report: plots and diagnosis built from a run directory's own files."""

from __future__ import annotations

import json

import pytest

from convergent.config import ConvergentConfig
from convergent.errors import RunDirError
from convergent.monitor.diagnosis import diagnose, step_breakdown
from convergent.monitor.report import PREDICTIONS, build_report
from convergent.runs import open_run
from convergent.trainrecords import TrainStep, ValRecord


def _steps(n=20, data=0.001, compute=0.01, comm=0.02, opt=0.001):
    return [TrainStep(step=i + 1, loss=1.0 / (i + 1), energy_mae=0.5, force_mae=0.3,
                      data_wait_s=data, compute_s=compute, comm_s=comm, optimizer_s=opt,
                      samples_per_s=100.0, mfu=0.05) for i in range(n)]


def test_breakdown_shares_sum_to_one_and_name_comm_bound():
    bd = step_breakdown(_steps())
    assert sum(bd.values()) == pytest.approx(1.0)
    assert max(bd, key=bd.get) == "comm"
    titles = [f.title for f in diagnose({}, _steps())]
    assert "training is communication-bound" in titles
    assert "training is input-bound" not in titles


def test_input_bound_and_dominant_stage_are_named():
    steps = _steps(data=0.05, compute=0.01, comm=0.0)
    stages = {"simulate": {"wall_s": 300.0}, "train": {"wall_s": 60.0}}
    titles = [f.title for f in diagnose(stages, steps)]
    assert titles[0] == "simulate dominates the run"
    assert "training is input-bound" in titles


def test_report_has_numbers_and_pngs(tmp_path):
    run = open_run(ConvergentConfig(), tmp_path / "r")
    run.mark_done("simulate", {"done": 40, "wall_s": 12.0, "frames_per_s": 3.3, "mean_calc_s": 0.25})
    run.mark_done("train", {"wall_s": 5.0})
    for row in _steps():
        run.log_metrics(row.to_dict())
    run.log_metrics(ValRecord(step=20, energy_mae=0.123, force_mae=0.456).to_dict())
    (run.path / PREDICTIONS).parent.mkdir(parents=True)
    (run.path / PREDICTIONS).write_text(json.dumps({
        "energy_true": [-10.0, -20.0, -30.0], "energy_pred": [-10.1, -19.8, -30.2],
        "n_atoms": [2, 4, 6], "energy_mae": 0.1667, "force_mae": 0.2,
        "seconds_per_structure": 0.0005, "reference": "GFN2-xTB"}))
    md = build_report(run.path).read_text()
    assert "0.123" in md and "0.456" in md
    assert "500x" in md  # 0.25 s per xTB calculation / 0.0005 s per surrogate structure
    for png in ("loss.png", "parity.png", "stages.png", "step_breakdown.png"):
        assert (run.report / png).stat().st_size > 1000
        assert f"]({png})" in md


def test_report_refuses_a_non_run_directory(tmp_path):
    with pytest.raises(RunDirError, match="not a run directory"):
        build_report(tmp_path)
