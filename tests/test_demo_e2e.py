"""A tiny but real converged loop: Dask + tblite -> shards -> torchrun DDP -> screen -> report."""

from __future__ import annotations

import json
import subprocess

from convergent.runsdb.trainrecords import read_train_records
from tests.cli_exe import EXE

TINY = ["--set", "simulate.frames=24", "--set", "simulate.max_atoms=5",
        "--set", "train.steps=6", "--set", "checkpoint.interval=3",
        "--set", "train.device=cpu",  # the 2-rank CPU job it asserts, on any machine
        "--set", "screen.md_check.seeds=1", "--set", "screen.md_check.time_fs=20"]


def test_tiny_loop_end_to_end_then_resume_and_refuse(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run([EXE, "demo", "--run-dir", str(run_dir), *TINY],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"report: {run_dir / 'report' / 'report.md'}" in out.stdout

    stages = json.loads((run_dir / "stages.json").read_text())
    assert list(stages) == ["simulate", "data", "train", "screen", "md_check", "learn"]
    assert stages["simulate"]["done"] == 24 and stages["simulate"]["quarantined"] == 0
    assert stages["data"]["train_frames"] + stages["data"]["val_frames"] == 24
    assert stages["train"]["steps"] == 6 and stages["train"]["nproc"] == 2

    # split by molecule: no molecule on both sides
    from convergent.data.reader import open_dataset

    train_mols = set(open_dataset(run_dir / "data" / "train").molecule_ids())
    val_mols = set(open_dataset(run_dir / "data" / "val").molecule_ids())
    assert train_mols and val_mols and not (train_mols & val_mols)

    # xTB labels are real: energies of distinct molecules differ and forces are non-zero
    labels = open_dataset(run_dir / "data" / "labels")
    rec = labels[0]
    assert rec["meta"]["program"] == "tblite" and abs(rec["forces"]).sum() > 0

    steps, vals = read_train_records(run_dir / "metrics.jsonl")
    assert steps and {r.world for r in steps} == {2}
    # issue 37: validation carries the per-element baseline, the report shows it beside
    assert vals and vals[-1].baseline_energy_mae and vals[-1].baseline_energy_mae > 0
    assert (run_dir / "ckpt" / "final").is_dir()

    md = (run_dir / "report" / "report.md").read_text()
    pred = json.loads((run_dir / "screen" / "predictions.json").read_text())
    assert f"{pred['energy_mae']:.4g}" in md
    assert "| val per-element baseline energy MAE (eV) | n/a" not in md
    assert "val per-element baseline energy MAE (eV)" in md and "baseline MAE / model MAE" in md
    # issue 37: the MD check ran every molecule with the trained surrogate, the report says so
    mdc = stages["md_check"]
    assert mdc["total_runs"] == 6 and mdc["time_fs"] == 20
    assert "## MD stability" in md and f"{mdc['stable_runs']} / 6" in md
    for png in ("loss.png", "parity.png", "stages.png"):
        assert (run_dir / "report" / png).stat().st_size > 1000

    # the final active-learning round: 8 structures chosen by the committee, labelled
    assert stages["learn"]["labels_added"] == 8 and stages["learn"]["rounds"] == 2
    added = open_dataset(run_dir / "active_learning" / "data" / "labels")
    assert len(added) == 8 and {added[i]["meta"]["round"] for i in range(8)} == {1}
    learn_md = (run_dir / "active_learning" / "report" / "learn.md").read_text()
    assert "per-element baseline (eV/atom)" in learn_md
    curve_rows = [ln for ln in learn_md.splitlines() if ln.startswith("| ") and ln.count("|") == 8]
    assert curve_rows and not any(ln.rstrip(" |").endswith("n/a") for ln in curve_rows[1:])
    # issue 37: its held-out molecules are ones the starting model never trained on
    held_mols = set(open_dataset(run_dir / "active_learning" / "data" / "holdout").molecule_ids())
    assert held_mols and not (held_mols & train_mols), sorted(held_mols & train_mols)

    # resume: everything done is skipped, nothing is recomputed
    again = subprocess.run([EXE, "demo", "--run-dir", str(run_dir), "--resume", *TINY],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("already done") == 6
    assert json.loads((run_dir / "stages.json").read_text()) == stages

    # without --resume the existing run is refused, untouched
    refused = subprocess.run([EXE, "demo", "--run-dir", str(run_dir), *TINY],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "already exists" in refused.stderr
    assert json.loads((run_dir / "stages.json").read_text()) == stages
