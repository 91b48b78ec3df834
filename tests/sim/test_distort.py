"""The rattle sampler's distorted frames (issue 37): a share of the campaign reaches the
short range, deterministically, never closer than the calculator's quarantine."""

from __future__ import annotations

import numpy as np

from convergent.core.elements import covalent_bonds
from convergent.sim.config import SimulateConfig
from convergent.sim.molecules import g2_molecules
from convergent.sim.plan import plan_tasks
from convergent.sim.resume import campaign_fingerprint
from convergent.sim.samplers import distort_positions


def _small():
    return [m for m in g2_molecules() if 3 <= len(m.numbers) <= 8
            and set(m.numbers.tolist()) <= {1, 6, 7, 8}]


def _items(frames: int, fraction: float = 0.2):
    sim = SimulateConfig(frames=frames, distort_fraction=fraction, chunk_size=50)
    return [it for t in plan_tasks(sim, _small()) for it in t.items]


def _min_distance(pos: np.ndarray) -> float:
    d = np.linalg.norm(pos[:, None] - pos[None], axis=-1)
    return float(d[np.triu_indices(len(pos), 1)].min())


def test_a_fifth_of_the_frames_is_distorted_frame_zero_never_every_kind_present():
    items = _items(1000)
    kinds = [it.meta.get("distort") for it in items]
    share = sum(k is not None for k in kinds) / len(items)
    assert 0.15 < share < 0.25
    assert {"compress", "angle", "bond"} == {k for k in kinds if k}
    assert all(it.meta.get("distort") is None for it in items if it.meta["frame"] == 0)
    assert not any(it.meta.get("distort") for it in _items(300, fraction=0.0))


def test_distorted_structures_are_seeded_and_reach_where_energies_rise():
    items = [it for it in _items(1000) if it.meta.get("distort")]
    again = {it.key: it for it in _items(1000)}
    short = {"angle": [], "bond": [], "compress": []}
    stretch = []
    for it in items:
        pos = it.structure()
        assert np.array_equal(pos, again[it.key].structure())  # same frame in any process
        bare = distort_positions(it.numbers, it.positions, 0, it.molecule_id, it.meta["frame"])[0]
        assert _min_distance(bare) >= 0.6 - 1e-9  # above the quarantine's 0.5 Å
        start = covalent_bonds(it.numbers, it.positions)
        d0 = np.linalg.norm(it.positions[start[:, 0]] - it.positions[start[:, 1]], axis=1)
        d1 = np.linalg.norm(bare[start[:, 0]] - bare[start[:, 1]], axis=1)
        short[it.meta["distort"]].append(float((d1 / d0).min()))
        stretch.append(float((d1 / d0).max()))
    # compressed and shortened bonds: well inside their length; a closed angle keeps them
    assert np.median(short["compress"]) < 0.93 and np.percentile(short["bond"], 25) < 0.9
    assert max(stretch) > 1.15  # and bonds stretched
    assert np.median(short["angle"]) > 0.99


def test_the_fraction_is_part_of_the_campaign_fingerprint():
    a = campaign_fingerprint(SimulateConfig())
    b = campaign_fingerprint(SimulateConfig(distort_fraction=0.0))
    assert a["distort_fraction"] == 0.2 and a != b


def test_a_tenth_of_the_frames_are_dimers_at_the_drawn_contact_with_partners_of_all_kinds():
    from convergent.sim.samplers import dimer_positions

    items = _items(1000)
    mols = {m.molecule_id: m for m in _small()}
    dimers = [it for it in items if it.meta.get("dimer")]
    assert 0.05 < len(dimers) / len(items) < 0.15  # 0.1 of the frames, singlets only
    assert not any(it.meta.get("distort") for it in dimers)
    assert all(it.meta["frame"] > 0 for it in dimers)
    partners = [it.meta["dimer"]["partner"] for it in dimers]
    assert sum(p != it.molecule_id for p, it in zip(partners, dimers, strict=True)) > len(dimers) // 2
    for it in dimers:
        mol, other = mols[it.molecule_id], mols[it.meta["dimer"]["partner"]]
        n = len(mol.numbers)
        assert it.numbers.tolist() == mol.numbers.tolist() + other.numbers.tolist()
        assert it.multiplicity == 1 and it.charge == mol.charge + other.charge
        a, b = it.positions[:n], it.positions[n:]
        gap = np.linalg.norm(a[:, None] - b[None], axis=-1).min()
        assert 1.4 - 0.01 <= gap <= 4.5 and abs(gap - it.meta["dimer"]["contact"]) < 1e-3
        # each molecule keeps its shape (rigid moves only)
        for got, ref in ((a, mol.positions), (b, other.positions)):
            np.testing.assert_allclose(np.linalg.norm(got[:, None] - got[None], axis=-1),
                                       np.linalg.norm(ref[:, None] - ref[None], axis=-1), atol=1e-9)
    again = dimer_positions(mols["g2-CH4"].positions, mols["g2-H2O"].positions, 0, "CH4", 7)
    np.testing.assert_array_equal(again[0], dimer_positions(mols["g2-CH4"].positions,
                                                            mols["g2-H2O"].positions, 0, "CH4", 7)[0])


def test_dimer_fraction_is_bounded_with_distortion_and_part_of_the_fingerprint():
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="distort_fraction \\+ dimer_fraction"):
        SimulateConfig(distort_fraction=0.6, dimer_fraction=0.5)
    assert not any(it.meta.get("dimer") for t in plan_tasks(
        SimulateConfig(frames=300, dimer_fraction=0.0), _small()) for it in t.items)
    assert (campaign_fingerprint(SimulateConfig(dimer_fraction=0.1))
            != campaign_fingerprint(SimulateConfig(dimer_fraction=0.0)))
