"""The rattle sampler's distorted frames (issue 37): a share of the campaign reaches the
short range, deterministically, never closer than the calculator's quarantine."""

from __future__ import annotations

import numpy as np

from convergent.elements import covalent_bonds
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
