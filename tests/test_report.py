"""The report: plots and diagnosis built from a run directory's own files."""

from __future__ import annotations

import json

import pytest

from convergent.config import ConvergentConfig
from convergent.core.errors import RunDirError
from convergent.monitor.diagnosis import diagnose, step_breakdown
from convergent.monitor.report import PREDICTIONS, build_report
from convergent.runsdb.rundir import open_run
from convergent.runsdb.trainrecords import TrainStep, ValRecord


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


def _heldout(tmp_path):
    """A run dir whose held-out predictions carry the baseline, per-atom forces and keys."""
    from convergent.monitor.accuracy import HeldoutPredictions

    run = open_run(ConvergentConfig(), tmp_path / "acc")
    run.mark_done("simulate", {"done": 40, "wall_s": 12.0, "mean_calc_s": 0.25})
    # H2O (8,1,1), CH4 (6,1,1,1,1), NH3 (7,1,1,1): refs H -10, C -1000, N -1400, O -2000 eV
    numbers = [[8, 1, 1], [6, 1, 1, 1, 1], [7, 1, 1, 1]]
    refs = {1: -10.0, 6: -1000.0, 7: -1400.0, 8: -2000.0}
    base = [sum(refs[z] for z in n) for n in numbers]
    true = [base[0] + 0.30, base[1] - 0.50, base[2] + 0.10]
    pred = [true[0] + 0.03, true[1] + 0.40, true[2] - 0.02]  # errors 0.03, 0.40, 0.02 eV
    f_true = [[0.1 * i, -0.2, 0.3] for i in range(12)]
    f_pred = [[x + (0.5 if z == 6 else 0.05), y, w] for (x, y, w), z in
              zip(f_true, sum(numbers, []), strict=True)]
    rec = HeldoutPredictions(
        n_atoms=[3, 5, 4], energy_true=true, energy_pred=pred, reference="GFN2-xTB",
        keys=["water-0", "methane-0", "ammonia-0"], molecule_ids=["water", "methane", "ammonia"],
        baseline_pred=base, baseline_refs={str(k): v for k, v in refs.items()},
        baseline_structures=30, numbers=sum(numbers, []), forces_true=f_true, forces_pred=f_pred,
        force_mae=0.05, seconds_per_structure=0.0005)
    rec.save(run.path / PREDICTIONS)
    return run, rec


def test_report_shows_baseline_next_to_model_with_parity_elements_and_outliers(tmp_path):
    run, rec = _heldout(tmp_path)
    s = rec.summary()
    assert s.energy_mae == pytest.approx(0.15) and s.baseline_energy_mae == pytest.approx(0.30)
    assert s.baseline_over_model == pytest.approx(2.0)
    md = build_report(run.path).read_text()
    assert "| eV per structure | 0.15 | 0.3 |" in md
    mev = (0.03 / 3 + 0.40 / 5 + 0.02 / 4) / 3 * 1e3
    mev_b = (0.30 / 3 + 0.50 / 5 + 0.10 / 4) / 3 * 1e3
    assert f"| meV/atom | {mev:.1f} | {mev_b:.1f} |" in md
    assert "**Baseline MAE / surrogate MAE: 2.00**" in md
    assert "30 training structures" in md
    # errors per element: C's atoms carry the 0.5 eV/Å x-error (mean over 3 components)
    assert "## Errors per element" in md
    c_row = next(line for line in md.splitlines() if line.startswith("| C |"))
    assert c_row.startswith(f"| C | 1 | {0.5 / 3:.4g} | 1 |")
    # worst structure first: methane, error +0.40 eV, +80 meV/atom, baseline +0.500
    worst = md.split("## Worst held-out structures")[1].splitlines()
    assert worst[3].startswith("| methane | methane-0 | CH4 | 5 | +0.400 | +80.0 | +0.500 |")
    assert worst[4].startswith("| water | water-0 | H2O | 3 |")
    assert len([w for w in worst if w.startswith("| ")]) == 2 + 3  # header, rule, one per molecule
    for png in ("parity.png", "force_parity.png", "element_errors.png"):
        assert (run.report / png).stat().st_size > 1000 and f"]({png})" in md


def test_report_says_when_the_model_is_worse_than_the_baseline(tmp_path):
    run, rec = _heldout(tmp_path)
    rec.energy_pred = [b + 1.0 for b in rec.baseline_pred]  # 1 eV off everywhere
    rec.save(run.path / PREDICTIONS)
    md = build_report(run.path).read_text()
    assert "WORSE than the baseline" in md


def test_report_refuses_unreadable_predictions_by_name(tmp_path):
    run = open_run(ConvergentConfig(), tmp_path / "bad")
    (run.path / PREDICTIONS).parent.mkdir(parents=True)
    (run.path / PREDICTIONS).write_text("[1, 2")
    with pytest.raises(RunDirError, match="predictions.json: unreadable predictions"):
        build_report(run.path)


def test_outliers_keep_the_worst_frame_of_each_molecule():
    from convergent.monitor.accuracy import HeldoutPredictions, outliers

    rec = HeldoutPredictions(
        n_atoms=[2, 2, 2, 2], energy_true=[0.0, 0.0, 0.0, None], energy_pred=[0.5, -0.9, 0.1, 5.0],
        keys=["a-0", "a-1", "b-0", "c-0"], molecule_ids=["a", "a", "b", "c"])
    worst = outliers(rec, k=5)
    assert [(o.key, o.error) for o in worst] == [("a-1", -0.9), ("b-0", 0.1)]  # c unlabelled
    assert rec.summary().baseline_energy_mae is None and rec.summary().baseline_over_model is None
