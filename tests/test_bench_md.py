"""The MD-stability bench (bench/models/md_stability.py, bench/models/molbench_md.py): its criteria on
hand-made trajectories, the NVE drift fit, the RDF's normalisation, and one tiny real run of
ours (trained on real GFN2-xTB labels) through the bench's own side runner and the harness,
against tblite's xTB MD from the same start."""

import os

import numpy as np
import pytest

from bench.models.molbench_md import (
    Criteria,
    covalent_bonds,
    drift_per_atom_ps,
    first_failure,
    pair_distance_density,
    rdf_distance,
    rdf_edges,
)

# water: O at the origin, two O-H bonds of 0.96 Å
WATER_Z = np.array([8, 1, 1])
WATER = np.array([[0.0, 0.0, 0.0], [0.96, 0.0, 0.0], [-0.24, 0.93, 0.0]])


def _traj(frames):
    return np.stack(frames), np.zeros(len(frames))


def test_bonds_of_the_start_geometry():
    bonds = {tuple(b) for b in covalent_bonds(WATER_Z, WATER).tolist()}
    assert bonds == {(0, 1), (0, 2)}  # H-H (1.5 Å) is no bond


def test_a_stretched_bond_is_flagged_a_vibrating_one_not():
    rng = np.random.default_rng(0)
    vib = [WATER + rng.normal(0, 0.03, WATER.shape) for _ in range(20)]
    pos, e = _traj([WATER, *vib])
    assert first_failure(WATER_Z, pos, e) is None
    stretched = WATER.copy()
    stretched[1, 0] = 0.96 * 1.6  # O-H at 1.6x its start length
    pos, e = _traj([WATER, *vib[:5], stretched, *vib[5:]])
    hit = first_failure(WATER_Z, pos, e)
    assert hit is not None and hit[0] == 6 and "bond 0-1 stretched" in hit[1]
    # 1.4x is inside the default 1.5x, outside a stricter 1.3x
    mild = WATER.copy()
    mild[1, 0] = 0.96 * 1.4
    pos, e = _traj([WATER, mild])
    assert first_failure(WATER_Z, pos, e) is None
    assert first_failure(WATER_Z, pos, e, Criteria(stretch=1.3)) is not None


def test_compressed_pair_energy_blow_up_and_nan_are_flagged():
    squashed = WATER.copy()
    squashed[2] = squashed[1] + [0.0, 0.6, 0.0]  # H-H at 0.6 Å, O-H bonds not stretched much
    pos, e = _traj([WATER, squashed])
    hit = first_failure(WATER_Z, pos, e, Criteria(stretch=10.0))
    assert hit is not None and "atoms 1-2 at 0.60" in hit[1]
    pos = np.stack([WATER, WATER, WATER])
    hit = first_failure(WATER_Z, pos, np.array([-10.0, -10.5, -14.0]))  # 4 eV / 3 atoms > 1
    assert hit is not None and hit[0] == 2 and "energy blow-up" in hit[1]
    bad = WATER.copy()
    bad[0, 0] = np.nan
    hit = first_failure(WATER_Z, np.stack([WATER, bad]), np.zeros(2))
    assert hit is not None and "non-finite" in hit[1]


def test_nve_drift_fit_recovers_a_known_slope():
    rng = np.random.default_rng(1)
    t = np.linspace(0.0, 2.0, 401)  # ps
    n = 9
    etot = -300.0 + n * 0.004 * t + rng.normal(0, 0.01, t.shape)  # 4 meV/atom/ps + noise
    assert drift_per_atom_ps(t, etot, n) == pytest.approx(0.004, abs=5e-4)
    assert drift_per_atom_ps(t, np.full_like(t, -300.0), n) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError):
        drift_per_atom_ps(t[:1], etot[:1], n)


def test_rdf_is_a_density_per_pair():
    edges = rdf_edges(r_max=4.0, dr=0.05)
    rng = np.random.default_rng(2)
    frames = np.stack([WATER + rng.normal(0, 0.02, WATER.shape) for _ in range(50)])
    g = pair_distance_density(frames, edges)
    assert np.sum(g * np.diff(edges)) == pytest.approx(1.0)  # every pair inside 4 Å
    peak = np.argmax(g)
    assert edges[peak] <= 0.96 + 0.05 and edges[peak + 1] >= 0.96 - 0.05  # the O-H peak
    # 2 of the 3 pairs are O-H: two thirds of the mass lies below 1.2 Å
    assert np.sum((g * np.diff(edges))[edges[1:] <= 1.2]) == pytest.approx(2 / 3, abs=0.02)
    small = rdf_edges(r_max=1.2, dr=0.05)
    assert np.sum(pair_distance_density(frames, small) * np.diff(small)) == pytest.approx(2 / 3, abs=0.02)
    assert rdf_distance(g, g, edges) == 0.0
    far = pair_distance_density(frames * 3.0, edges)
    # no overlap: 1 (all of g) + 2/3 (far's O-H pairs at ~2.9 Å; its H-H at ~4.5 Å is past r_max)
    assert rdf_distance(g, far, edges) == pytest.approx(5 / 3, abs=0.02)
    wide = rdf_edges(r_max=8.0)
    assert rdf_distance(pair_distance_density(frames, wide), pair_distance_density(frames * 3.0, wide),
                        wide) == pytest.approx(2.0, abs=0.02)  # disjoint, all inside: 2


@pytest.fixture(scope="module")
def xtb_records():
    """3 G2 molecules x 4 rattled copies, labelled by GFN2-xTB (one OpenMP thread)."""
    pytest.importorskip("tblite")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from bench.models.molbench import conformers, label_frames

    frames = []
    for i, name in enumerate(("H2O", "CH4", "NH3", "HCN")):
        frames += conformers(name, 4, seed=i)
    return [{"key": a.info["key"], "molecule_id": a.info["molecule_id"],
             "numbers": np.asarray(a.numbers, np.int64), "positions": np.asarray(a.positions),
             "energy": float(a.info["energy_eV"]), "forces": np.asarray(a.arrays["forces_eVA"])}
            for a in label_frames(frames, "xtb")]


class _OneFold:
    """The bench's Folds for a test: one fixed (train, test, references) split."""

    def __init__(self, train, test):
        from convergent.models.molecular import fit_reference_energies

        self.split = (train, test, fit_reference_energies(train))

    def get(self, fold):
        return self.split


def test_tiny_real_md_run_through_the_bench(xtb_records):
    from bench.lib.harness import Side, interleave
    from bench.models import md_stability as ms

    train = [r for r in xtb_records if r["molecule_id"] != "NH3"]
    test = [r for r in xtb_records if r["molecule_id"] == "NH3"]
    args = ms.parse(["--models", "ours", "--budget", "2", "--hidden", "16", "--layers", "1",
                     "--molecules", "1", "--ps", "0.01", "--nve-thermalise-fs", "5",
                     "--record-every", "5", "--seeds", "1", "--folds", "2"])
    starts = ms.md_starts(test, args.molecules)
    assert [s["molecule_id"] for s in starts] == ["NH3"]
    edges, T0 = rdf_edges(), args.temps[0]
    ref = ms.xtb_reference(starts, args, T0, edges)
    assert ref["stable_fraction_300K"] == 1.0  # xTB keeps NH3 physical for 20 steps
    assert ref["md_steps"] == 20
    ref_g = np.asarray(ref["rdf_300K"])
    assert np.sum(ref_g * np.diff(edges)) == pytest.approx(1.0)
    run = ms.side_runner("ours", args, _OneFold(train, test), starts, args.temps, edges, ref_g)
    res = interleave("md_stability", [Side("ours", run)], rounds=1, progress=False)
    row = res.per_round["ours"][0]
    for tag in ("300K", "600K"):
        frac, first = row[f"stable_fraction_{tag}"], row[f"first_failure_ps_{tag}"]
        assert frac in (0.0, 1.0) and len(first) == 1
        assert (frac == 1.0) == (first[0] is None)  # stable iff no failure time
        assert (frac == 1.0) == (not row[f"failure_reasons_{tag}"])
    assert len(row["nve_drift_eV_per_atom_per_ps"]) == 1
    assert 0.0 <= row["rdf_distance_to_xtb_300K"] <= 2.0
    assert ref["rdf_frame_coverage_300K"] == 1.0  # 20 steps / 5 + the start = 5 frames, all there
    assert 0.0 < row["rdf_frame_coverage_300K"] <= 1.0
    assert row["md_steps"] > 0 and row["md_seconds_per_step"] > 0
    assert res.median("ours", "stable_fraction_300K") == row["stable_fraction_300K"]


@pytest.mark.numerics
@pytest.mark.parametrize("ensemble", ["langevin", "nve"])
def test_batched_md_of_a_model_is_each_molecules_own_ase_run(ensemble):
    """md_stability runs a model's molecules together (run_batched, BatchMD); each one's
    trajectory, energies and failure are those of the bench's one-molecule ASE loop
    (run_md with the product's calculator) from the same start and seed."""
    import torch
    from ase.build import molecule

    from bench.models.molbench_md import run_batched, run_md
    from convergent.models.calculator import SurrogateCalculator
    from convergent.models.config import ModelConfig
    from convergent.models.molecular import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(hidden=16, layers=1, heads=2)).eval()
    starts = [{"numbers": molecule(n).numbers, "positions": molecule(n).positions}
              for n in ("H2O", "CH3OH", "NH3")]
    seeds, kw = [5, 6, 7], {"timestep_fs": 0.5, "friction_per_fs": 0.02, "record_every": 4,
                            "criteria": Criteria()}
    warm = 6 if ensemble == "nve" else 0
    got = run_batched(model, starts, 300.0, 16, seeds, ensemble=ensemble, thermalise_steps=warm, **kw)
    for s, seed, g in zip(starts, seeds, got, strict=True):
        ref = run_md(s["numbers"], s["positions"], SurrogateCalculator(model), 300.0, 16, seed,
                     ensemble=ensemble, thermalise_steps=warm, **kw)
        assert g.reason == ref.reason and g.steps == ref.steps
        assert g.times_ps == pytest.approx(ref.times_ps)
        # float32 forces, packed or alone: summation order only (see tests/screen/test_batchmd.py)
        np.testing.assert_allclose(np.stack(g.positions), np.stack(ref.positions), atol=1e-5)
        eps = float(torch.finfo(torch.float32).eps)
        scale = max(abs(e) for e in ref.potential)
        np.testing.assert_allclose(g.potential, ref.potential, atol=1e3 * eps * scale)
        np.testing.assert_allclose(g.total, ref.total, atol=1e3 * eps * scale)
