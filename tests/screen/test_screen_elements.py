"""Issue 37: a model refuses elements it was not trained on; screen writes strict JSON.

A tiny surrogate is trained on GFN2-xTB (tblite) labels of rattled H/C/O molecules; the
checkpoint records those elements, and the calculator and ``convergent screen`` refuse a
structure with Cl in it, naming the element and the structure.
"""

from __future__ import annotations

import json

import ase.io
import numpy as np
import pytest
import torch
from ase.build import molecule

from convergent.cli import main
from convergent.core.errors import InputError
from convergent.core.fsutil import loads_strict
from convergent.models.batching import atoms_to_record, collate_records
from convergent.models.calculator import SurrogateCalculator
from convergent.models.config import ModelConfig
from convergent.models.io import load_model, save_model
from convergent.models.losses import energy_force_loss
from convergent.models.molecular import build_model, energy_and_forces, fit_reference_energies
from convergent.sim.calculators import CalcSpec, make_calculator

HCO = ["H2O", "CH4", "CH3OH", "H2CO", "C2H6"]


def _xtb_records() -> list[dict]:
    recs = []
    for i, name in enumerate(HCO * 2):
        a = molecule(name)
        a.rattle(0.03, seed=i)
        a.calc = make_calculator(CalcSpec(kind="xtb"))
        r = atoms_to_record(a, f"{name}-{i}")
        r["energy"], r["forces"] = float(a.get_potential_energy()), a.get_forces().copy()
        r["molecule_id"] = name
        recs.append(r)
    return recs


@pytest.fixture(scope="module")
def hco_model(tmp_path_factory):
    """A surrogate trained (20 Adam steps) on xTB labels of H/C/O molecules, saved."""
    recs = _xtb_records()
    torch.manual_seed(0)
    cfg = ModelConfig(hidden=16, layers=1, cutoff=4.0)
    model = build_model(cfg)
    model.set_reference(fit_reference_energies(recs))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = collate_records(recs)
    for _ in range(20):
        e, f = energy_and_forces(model, batch, training=True)
        loss, _ = energy_force_loss(e, f, batch, force_weight=1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return save_model(model.eval(), cfg, tmp_path_factory.mktemp("hco") / "model")


def test_checkpoint_records_the_training_elements(hco_model):
    meta = json.loads((hco_model / "model_config.json").read_text())
    assert meta["elements"] == [1, 6, 8]
    assert load_model(hco_model)[0].trained_elements == (1, 6, 8)


def test_calculator_refuses_an_unknown_element_naming_it_and_the_structure(hco_model):
    calc = SurrogateCalculator(hco_model)
    water = molecule("H2O")
    water.calc = calc
    assert np.isfinite(water.get_potential_energy())
    cl = molecule("CH3Cl")
    cl.info["key"] = "chloromethane-7"
    cl.calc = calc
    with pytest.raises(InputError) as err:
        cl.get_potential_energy()
    assert "Cl" in str(err.value) and "chloromethane-7" in str(err.value)
    nh3 = molecule("NH3")  # no key: the structure is named by its formula
    nh3.calc = calc
    with pytest.raises(InputError, match=r"structure H3N: element N \(Z=7\)"):
        nh3.get_forces()


def test_screen_cli_exits_2_naming_the_element_and_the_frame(hco_model, tmp_path, capsys):
    path = tmp_path / "mixed.extxyz"
    ase.io.write(path, [molecule("H2O"), molecule("CH3Cl"), molecule("CH4")])
    out = tmp_path / "out"
    code = main(["screen", "--data", str(path), "--out", str(out), "--model", str(hco_model)])
    err = capsys.readouterr().err
    assert code == 2
    assert "element Cl (Z=17)" in err and f"{path} frame #1" in err
    assert not out.exists()  # nothing half-written


def test_old_checkpoint_without_the_record_uses_its_reference_energies(hco_model, tmp_path):
    model, cfg = load_model(hco_model)
    old = save_model(model, cfg, tmp_path / "old")
    meta_path = old / "model_config.json"
    meta = json.loads(meta_path.read_text())
    del meta["elements"]  # as written before the record existed
    meta_path.write_text(json.dumps(meta))
    assert load_model(old)[0].trained_elements is None
    with pytest.raises(InputError, match="Cl"):
        SurrogateCalculator(old).get_potential_energy(molecule("CH3Cl"))
    untrained = save_model(build_model(cfg), cfg, tmp_path / "untrained")
    meta = json.loads((untrained / "model_config.json").read_text())
    assert meta["elements"] is None and meta["elements_null_reason"]
    del meta["elements"]
    (untrained / "model_config.json").write_text(json.dumps(meta))
    with pytest.raises(InputError, match="predates element recording"):
        load_model(untrained)


def test_screen_summary_is_strict_json_with_null_reasons(hco_model, tmp_path):
    path = tmp_path / "unlabelled.extxyz"
    ase.io.write(path, [molecule("H2O"), molecule("CH4")])
    out = tmp_path / "out"
    assert main(["screen", "--data", str(path), "--out", str(out), "--model", str(hco_model)]) == 0
    summary = loads_strict((out / "summary.json").read_text())
    assert summary["energy_mae_eV"] is None
    assert summary["energy_mae_eV_null_reason"] == "no structure has a reference energy"
    assert summary["mean_energy_std_eV_null_reason"] == "one model: no ensemble spread"
    for line in (out / "predictions.jsonl").read_text().splitlines():
        loads_strict(line)


def test_screen_shows_the_per_element_baseline_beside_the_model(hco_model, tmp_path, capsys):
    """Issue 37: `convergent screen` judges its MAE against the per-element baseline of the
    model's own training data (its element reference energies), with their ratio."""
    frames, truth = [], []
    for i, name in enumerate(HCO):  # fresh rattles, labelled by GFN2-xTB
        a = molecule(name)
        a.rattle(0.04, seed=100 + i)
        a.calc = make_calculator(CalcSpec(kind="xtb"))
        a.get_potential_energy()
        frames.append(a)
        truth.append(float(a.get_potential_energy()))
    path = tmp_path / "labelled.extxyz"
    ase.io.write(path, frames)
    out = tmp_path / "out"
    assert main(["screen", "--data", str(path), "--out", str(out), "--model", str(hco_model)]) == 0
    said = capsys.readouterr().out
    summary = loads_strict((out / "summary.json").read_text())
    # the baseline, computed here from the training labels: least squares on element counts
    ref = fit_reference_energies(_xtb_records()).energies
    base = [sum(ref[int(z)] for z in a.numbers) for a in frames]
    expect = float(np.mean(np.abs(np.asarray(base) - np.asarray(truth))))
    assert summary["baseline_energy_mae_eV"] == pytest.approx(expect, rel=1e-6)
    assert summary["baseline_over_model"] == pytest.approx(expect / summary["energy_mae_eV"])
    assert "per-element baseline" in said and f"{expect:.4g} eV" in said
    rows = [loads_strict(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [r["baseline_pred"] for r in rows] == pytest.approx(base, rel=1e-9)
