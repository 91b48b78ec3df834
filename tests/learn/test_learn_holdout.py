"""Issue 37: learn's held-out molecules are disjoint from its starting data (the dataset the
starting model was trained on), however the seeded hash would have picked them."""

from __future__ import annotations

import numpy as np
import pytest

from convergent.core.errors import InputError
from convergent.data.writer import DatasetWriter
from convergent.learn.config import LEARN_PRESET, PoolConfig
from convergent.learn.pool import build_pool, dataset_molecules, is_holdout
from convergent.sim.config import SimulateConfig
from convergent.sim.records import make_record
from convergent.sim.sources import load_molecules

POOL = PoolConfig(conformers=1, holdout_per_molecule=1, holdout_fraction=0.3)


def _sim(**kw) -> SimulateConfig:
    return SimulateConfig(source="g2", max_atoms=8, **kw)


def _starting_data(path, mols) -> None:
    """A dataset of one record per molecule, as a campaign writes them (ids as learn's)."""
    rng = np.random.default_rng(0)
    with DatasetWriter(path) as w:
        for m in mols:
            n = len(m.numbers)
            w.write(make_record(f"{m.molecule_id}/0", m.molecule_id, m.numbers, m.positions,
                                0, 1, -1.0 * n, rng.normal(size=(n, 3)), {"frame": 0}))


def test_held_out_molecules_are_never_in_the_starting_data(tmp_path):
    sim = _sim()
    mols, _ = load_molecules(sim.source, sim.elements, sim.min_atoms, sim.max_atoms,
                             sim.max_molecules, 0, on_bad_input="quarantine")
    # the starting data: 80% of the molecules, among them most that the hash holds out
    taken = mols[: int(0.8 * len(mols))]
    by_hash = {m.molecule_id for m in mols if is_holdout(m.molecule_id, 0.3, 0)}
    assert by_hash & {m.molecule_id for m in taken}  # the old rule would leak
    _starting_data(tmp_path / "train", taken)
    seen = dataset_molecules(str(tmp_path / "train"))
    assert seen == {m.molecule_id for m in taken}
    pool, held = build_pool(POOL, sim, 0, seen=seen)
    held_ids = {c.molecule_id for c in held}
    assert held_ids and not (held_ids & seen)
    assert len(held_ids) == min(len(by_hash), len(mols) - len(taken))
    # every molecule is in exactly one of pool and held-out
    assert {c.molecule_id for c in pool} | held_ids == {m.molecule_id for m in mols}
    assert not ({c.molecule_id for c in pool} & held_ids)
    # without starting data the seeded hash decides, as before
    _, held0 = build_pool(POOL, sim, 0)
    assert {c.molecule_id for c in held0} == by_hash


def test_a_pool_entirely_in_the_starting_data_is_refused(tmp_path):
    sim = _sim(max_molecules=4)
    mols, _ = load_molecules(sim.source, sim.elements, sim.min_atoms, sim.max_atoms,
                             sim.max_molecules, 0, on_bad_input="quarantine")
    with pytest.raises(InputError, match="none can be held out unseen"):
        build_pool(POOL, sim, 0, seen=frozenset(m.molecule_id for m in mols))


def test_learn_force_weight_default_is_the_demos():
    from convergent.demo import DEMO_PRESET

    assert LEARN_PRESET["train"]["force_weight"] == DEMO_PRESET["train"]["force_weight"] == 1.0
