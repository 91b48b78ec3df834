"""Save/load round trip and the ASE calculator."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase.build import molecule
from ase.optimize import BFGS

from convergent.core.errors import InputError
from convergent.models.batching import atoms_to_record, collate_records
from convergent.models.calculator import SurrogateCalculator
from convergent.models.config import ModelConfig
from convergent.models.io import load_model, save_model
from convergent.models.molecular import ReferenceEnergies, build_model, energy_and_forces


@pytest.fixture()
def saved(tmp_path):
    torch.manual_seed(1)
    cfg = ModelConfig(hidden=32, layers=2, cutoff=4.0)
    m = build_model(cfg)
    m.set_reference(ReferenceEnergies({1: -13.6, 8: -2040.0}, scale=0.7))
    save_model(m, cfg, tmp_path / "m", extra={"note": "test"})
    return m, tmp_path / "m"


def test_save_load_round_trip_predicts_identically(saved):
    m, d = saved
    m2, cfg2 = load_model(d)
    assert cfg2.cutoff == 4.0 and cfg2.hidden == 32
    b = collate_records([atoms_to_record(molecule("H2O"))])
    e1, f1 = energy_and_forces(m, b, training=False)
    e2, f2 = energy_and_forces(m2, b, training=False)
    assert torch.equal(e1, e2) and torch.equal(f1, f2)
    assert float(e1) < -2000  # absolute energy includes the element references


def test_checkpoint_from_before_head_norm_loads_with_the_head_layernorm(tmp_path):
    """Configs saved before ``model.head_norm`` existed lack the field; those models had a
    LayerNorm at the head's input, so loading must rebuild it (not the new default)."""
    import json

    torch.manual_seed(2)
    cfg = ModelConfig(hidden=16, layers=1, cutoff=4.0, head_norm=True)
    m = build_model(cfg)
    with torch.no_grad():
        m.energy_head[0].weight.mul_(1.7)  # a non-default LayerNorm weight must survive
    save_model(m, cfg, tmp_path / "old")
    meta_path = tmp_path / "old" / "model_config.json"
    meta = json.loads(meta_path.read_text())
    del meta["model"]["head_norm"]
    meta_path.write_text(json.dumps(meta))
    m2, cfg2 = load_model(tmp_path / "old")
    assert cfg2.head_norm and isinstance(m2.energy_head[0], torch.nn.LayerNorm)
    b = collate_records([atoms_to_record(molecule("H2O"))])
    assert torch.equal(m(b), m2(b))
    assert not isinstance(build_model(ModelConfig()).energy_head[0], torch.nn.LayerNorm)  # new default


def test_load_errors_are_user_errors(tmp_path):
    with pytest.raises(InputError, match="not a model directory"):
        load_model(tmp_path)
    (tmp_path / "model_config.json").write_text("{bad json")
    (tmp_path / "model.safetensors").write_bytes(b"junk")
    with pytest.raises(InputError, match=r"model_config\.json:1: not valid JSON"):
        load_model(tmp_path)


def test_ase_calculator_energy_forces_and_ensemble(saved, tmp_path):
    m, d = saved
    atoms = molecule("H2O")
    atoms.calc = SurrogateCalculator(d)
    e = atoms.get_potential_energy()
    f = atoms.get_forces()
    b = collate_records([atoms_to_record(molecule("H2O"))])
    e_ref, f_ref = energy_and_forces(m, b, training=False)
    assert e == pytest.approx(float(e_ref), abs=1e-6)
    assert np.allclose(f, f_ref.numpy(), atol=1e-5)
    assert atoms.get_potential_energies().sum() == pytest.approx(e, abs=1e-5)
    # An optimiser can use it (forces are consistent with the energy).
    atoms.rattle(0.05, seed=0)
    e_start = atoms.get_potential_energy()
    assert np.abs(atoms.get_forces()).max() > 1e-3
    BFGS(atoms, logfile=None).run(fmax=1e-4, steps=20)
    assert atoms.get_potential_energy() < e_start
    # Ensemble: spread reported
    torch.manual_seed(2)
    other = build_model(m.cfg)
    other.load_state_dict(m.state_dict())
    with torch.no_grad():
        other.energy_head[-1].bias.add_(0.1)
    save_model(other, m.cfg, tmp_path / "m2")
    a2 = molecule("H2O")
    a2.calc = SurrogateCalculator([d, tmp_path / "m2"])
    a2.get_potential_energy()
    assert a2.calc.results["energy_std"] == pytest.approx(0.1 * 0.7 * 3 / 2**0.5, rel=1e-3)


def test_ase_calculator_uses_the_direct_force_head(tmp_path):
    torch.manual_seed(2)
    cfg = ModelConfig(hidden=32, layers=2, cutoff=4.0, forces="direct")
    m = build_model(cfg)
    save_model(m, cfg, tmp_path / "direct")
    atoms = molecule("CH4")
    atoms.calc = SurrogateCalculator(tmp_path / "direct")
    f = atoms.get_forces()
    b = collate_records([atoms_to_record(molecule("CH4"))])
    e_ref, f_ref = energy_and_forces(m, b, training=False)  # direct head's forces
    assert atoms.get_potential_energy() == pytest.approx(float(e_ref), abs=1e-6)
    assert np.allclose(f, f_ref.numpy(), atol=1e-6)
