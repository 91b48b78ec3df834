"""Screening: ensemble prediction over a real dataset store, selection, the CLI."""

from __future__ import annotations

import json

import ase.io
import numpy as np
import pytest
import torch
from ase.build import molecule

from convergent.cli import main
from convergent.data.writer import write_records
from convergent.models.batching import atoms_to_record, collate_records
from convergent.models.config import ModelConfig
from convergent.models.io import save_model
from convergent.models.molecular import build_model, energy_and_forces
from convergent.screen.predict import predict_dataset
from convergent.screen.select import select_uncertain, write_selection


def _records():
    recs = []
    for i, name in enumerate(["H2O", "NH3", "CH4", "C2H6", "CH3OH", "HCN"] * 2):
        a = molecule(name)
        a.rattle(0.05 + 0.02 * i, seed=i)
        r = atoms_to_record(a, f"{name}-{i}")
        r["molecule_id"] = name
        r["energy"] = -10.0 * len(a)
        r["forces"] = np.zeros((len(a), 3))
        recs.append(r)
    return recs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("screen")
    recs = _records()
    write_records(root / "ds", recs)
    dirs = []
    for seed in range(3):
        torch.manual_seed(seed)
        cfg = ModelConfig(hidden=16, layers=1, cutoff=4.0)
        m = build_model(cfg)
        dirs.append(save_model(m, cfg, root / f"m{seed}"))
    return root, recs, dirs


def test_predict_dataset_ensemble_matches_models(setup):
    root, recs, dirs = setup
    res = predict_dataset(dirs, root / "ds", batch_atoms=20)
    assert len(res) == len(recs) and res.n_models == 3
    assert res.keys == [r["key"] for r in recs]
    # Ensemble mean equals the mean of each model's own prediction.
    from convergent.models.io import load_model

    b = collate_records(recs)
    es = torch.stack([energy_and_forces(load_model(d)[0], b, False)[0] for d in dirs])
    assert np.allclose(res.energy_pred, es.mean(0).numpy(), atol=1e-6)
    assert np.allclose(res.energy_std, es.std(0).numpy(), atol=1e-6)
    assert np.all(res.force_std > 0)
    assert np.allclose(res.energy_true, [r["energy"] for r in recs])
    assert res.energy_mae == pytest.approx(float(np.abs(res.energy_pred - res.energy_true).mean()))
    assert res.seconds_per_structure > 0
    single = predict_dataset(dirs[0], root / "ds")
    assert np.isnan(single.energy_std).all()


def test_select_most_uncertain_with_per_molecule_limit(setup, tmp_path):
    root, recs, dirs = setup
    res = predict_dataset(dirs, root / "ds")
    picked = select_uncertain(res, 4, "force_std")
    assert picked == list(np.argsort(-res.force_std)[:4])
    limited = select_uncertain(res, 4, "force_std", max_per_molecule=1)
    assert len({res.molecule_ids[i] for i in limited}) == 4
    paths = write_selection(res, limited, [recs[i] for i in limited], tmp_path)
    sel = json.loads(paths["json"].read_text())["selected"]
    assert [s["key"] for s in sel] == [res.keys[i] for i in limited]
    frames = ase.io.read(paths["extxyz"], index=":")
    assert [len(f) for f in frames] == [len(recs[i]["numbers"]) for i in limited]


def test_cli_screen_writes_predictions_and_selection(setup, tmp_path):
    root, recs, dirs = setup
    out = tmp_path / "out"
    args = ["screen", "--data", str(root / "ds"), "--out", str(out), "--select", "3"]
    for d in dirs:
        args += ["--model", str(d)]
    assert main(args) == 0
    lines = (out / "predictions.jsonl").read_text().splitlines()
    assert len(lines) == len(recs)
    assert len(json.loads((out / "selected.json").read_text())["selected"]) == 3
    # extxyz input works too, and a missing model is a clean user error (exit 2)
    ase.io.write(tmp_path / "s.extxyz", [molecule("H2O"), molecule("CH4")])
    assert main(["screen", "--data", str(tmp_path / "s.extxyz"), "--out", str(out / "x"),
                 "--model", str(dirs[0])]) == 0
    assert main(["screen", "--data", str(root / "ds"), "--model", str(tmp_path / "nope")]) == 2


def test_keep_atoms_returns_each_atoms_forces_in_structure_order(setup):
    root, recs, dirs = setup
    res = predict_dataset(dirs[0], root / "ds", batch_atoms=20, keep_atoms=True)
    from convergent.models.io import load_model

    _, f = energy_and_forces(load_model(dirs[0])[0], collate_records(recs), False)
    assert res.numbers.tolist() == np.concatenate([r["numbers"] for r in recs]).tolist()
    assert np.allclose(res.forces_pred, f.detach().double().numpy(), atol=1e-5)
    assert np.array_equal(res.forces_true, np.zeros((len(res.numbers), 3)))
    # per-structure force MAE agrees with the kept per-atom forces
    assert res.force_mae_total == pytest.approx(float(np.abs(res.forces_pred).mean()), rel=1e-6)
    assert predict_dataset(dirs[0], root / "ds").numbers.size == 0  # off by default
