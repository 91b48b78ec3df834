"""Calculators (real tblite, real PySCF, EMT) and samplers (rattle, Langevin MD)."""

from __future__ import annotations

import numpy as np
import pytest

from convergent.sim.calculators import (
    BadGeometry,
    CalcSpec,
    Labeller,
    SCFNotConverged,
    make_calculator,
)
from convergent.sim.config import RelabelConfig, SimulateConfig
from convergent.sim.samplers import langevin_frames, rattle_positions
from convergent.sim.sources import load_molecules


def _water():
    mols, _ = load_molecules("g2", ["H", "O"], 3, 3)
    return next(m for m in mols if m.molecule_id == "g2-H2O")


def _fd_force(lab: Labeller, mol, atom: int, axis: int, h: float = 1e-4) -> float:
    p = mol.positions.copy()
    p[atom, axis] += h
    ep = lab.label(mol.numbers, p, mol.charge, mol.multiplicity)[0]
    p[atom, axis] -= 2 * h
    em = lab.label(mol.numbers, p, mol.charge, mol.multiplicity)[0]
    return -(ep - em) / (2 * h)


def test_xtb_energy_forces_and_provenance():
    spec = CalcSpec.from_simulate(SimulateConfig())
    assert (spec.kind, spec.method) == ("xtb", "GFN2-xTB")
    prov = spec.provenance()
    assert prov["program"] == "tblite" and prov["version"] != "unknown"
    assert prov["method"] == "GFN2-xTB" and "accuracy" in prov["settings"]
    mol = _water()
    lab = Labeller(spec)
    e, f, wall = lab.label(mol.numbers, mol.positions)
    assert -200 < e < -100  # GFN2 water is about -137.9 eV
    assert f.shape == (3, 3) and wall > 0
    np.testing.assert_allclose(f.sum(axis=0), 0.0, atol=1e-6)  # no net force
    assert f[0, 2] == pytest.approx(_fd_force(lab, mol, 0, 2), abs=1e-4)
    # same structure, same numbers (fresh calculator per call, no carried-over guess)
    e2, f2, _ = lab.label(mol.numbers, mol.positions)
    assert e2 == pytest.approx(e, abs=1e-10)
    np.testing.assert_allclose(f2, f, rtol=0, atol=1e-10)


def test_xtb_open_shell_uses_multiplicity():
    mols, _ = load_molecules("g2", ["H", "O"], 2, 2)
    oh = next(m for m in mols if m.molecule_id == "g2-OH")
    lab = Labeller(CalcSpec())
    e_doublet = lab.label(oh.numbers, oh.positions, 0, 2)[0]
    e_quartet = lab.label(oh.numbers, oh.positions, 0, 4)[0]
    assert e_doublet < e_quartet


def test_pyscf_hf_forces_match_finite_differences():
    rel = RelabelConfig(method="HF", basis="sto-3g", density_fit=False)
    spec = CalcSpec.from_relabel(rel)
    assert spec.provenance()["program"] == "pyscf"
    assert spec.level == "HF/sto-3g"
    mol = _water()
    lab = Labeller(spec)
    e, f, _ = lab.label(mol.numbers, mol.positions)
    assert e == pytest.approx(-74.96 * 27.211386, rel=2e-3)  # HF/STO-3G water ~ -74.96 Ha
    assert f[1, 1] == pytest.approx(_fd_force(lab, mol, 1, 1, 1e-3), abs=2e-3)


def test_pyscf_dft_density_fitting_and_scf_failure():
    mol = _water()
    spec = CalcSpec.from_relabel(RelabelConfig(method="PBE", basis="sto-3g", density_fit=True))
    e, f, _ = Labeller(spec).label(mol.numbers, mol.positions)
    assert np.isfinite(e) and f.shape == (3, 3)
    bad = CalcSpec.from_relabel(RelabelConfig(method="HF", basis="6-31G", density_fit=False,
                                              max_cycle=1))
    with pytest.raises(SCFNotConverged, match="not converged"):
        Labeller(bad).label(mol.numbers, mol.positions)


def test_bad_geometry_is_rejected_before_calculating():
    mol = _water()
    p = mol.positions.copy()
    p[1] = p[0] + [0.0, 0.0, 0.2]
    with pytest.raises(BadGeometry, match="atoms 0 and 1"):
        Labeller(CalcSpec()).label(mol.numbers, p)
    p[1] = np.nan
    with pytest.raises(BadGeometry, match="non-finite"):
        Labeller(CalcSpec()).label(mol.numbers, p)


def test_rattle_is_seeded_per_molecule_and_frame():
    pos = np.zeros((400, 3))
    a = rattle_positions(pos, 0.1, 0, "m", 3)
    assert np.array_equal(a, rattle_positions(pos, 0.1, 0, "m", 3))
    assert not np.allclose(a, rattle_positions(pos, 0.1, 0, "m", 4))
    assert not np.allclose(a, rattle_positions(pos, 0.1, 1, "m", 3))
    assert a.std() == pytest.approx(0.1, rel=0.1)


def test_langevin_md_reproducible_and_temperature_dependent():
    mol = _water()
    spec = CalcSpec()

    def run(temp, seed=0):
        calc = make_calculator(spec, mol.charge, mol.multiplicity)
        return list(langevin_frames(mol, calc, temp, n_frames=4, interval=3, warmup=2,
                                    seed=seed))

    a, b = run(300.0), run(300.0)
    assert [fr.step for fr in a] == [5, 8, 11, 14]
    for x, y in zip(a, b, strict=True):  # equal up to OpenMP summation order in this (threaded) process
        np.testing.assert_allclose(x.positions, y.positions, rtol=0, atol=1e-9)
        assert x.energy == pytest.approx(y.energy, abs=1e-9)
    c = run(300.0, seed=1)
    assert not np.allclose(a[-1].positions, c[-1].positions)
    # the saved forces belong to the saved positions
    lab = Labeller(spec)
    e, f, _ = lab.label(mol.numbers, a[2].positions)
    assert a[2].energy == pytest.approx(e, abs=1e-6)
    np.testing.assert_allclose(a[2].forces, f, atol=1e-3)  # SCF tolerance (MD reuses guesses)
    # centre of mass stays put
    masses = np.array([15.999, 1.008, 1.008])
    com0 = masses @ mol.positions / masses.sum()
    np.testing.assert_allclose(masses @ a[-1].positions / masses.sum(), com0, atol=1e-8)


def test_emt_calculator_for_tests():
    spec = CalcSpec(kind="emt", method="EMT")
    assert spec.provenance()["program"] == "ase"
    mol = _water()
    e, f, _ = Labeller(spec).label(mol.numbers, mol.positions)
    assert np.isfinite(e) and np.all(np.isfinite(f))
