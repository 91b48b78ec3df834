"""MACE as a bench peer (bench/models/molbench_mace.py): mace-torch's own model trained by our
loop on a tiny real GFN2-xTB set (tblite) learns, and its forces are -dE/dx."""

import os

import numpy as np
import pytest

from bench.models.molbench_mace import mace_available

KEY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"  # `import mace` sets it for the whole process
ENV_BEFORE = os.environ.get(KEY)
OK, WHY = mace_available()
pytestmark = pytest.mark.skipif(not OK, reason=WHY)

torch = pytest.importorskip("torch")
pytest.importorskip("tblite")


@pytest.fixture(scope="module")
def xtb_records():
    """3 G2 molecules x 4 rattled copies, labelled by GFN2-xTB (one OpenMP thread)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from bench.models.molbench import conformers, label_frames

    frames = []
    for i, name in enumerate(("H2O", "CH4", "NH3")):
        frames += conformers(name, 4, seed=i)
    return [{"key": a.info["key"], "molecule_id": a.info["molecule_id"],
             "numbers": np.asarray(a.numbers, np.int64), "positions": np.asarray(a.positions),
             "energy": float(a.info["energy_eV"]), "forces": np.asarray(a.arrays["forces_eVA"])}
            for a in label_frames(frames, "xtb")]


def _loss(pot, records):
    from convergent.models.batching import collate_records
    from convergent.models.losses import energy_force_loss

    b = collate_records(records)
    e, f = pot.predict(b, training=False)
    assert torch.isfinite(e).all() and torch.isfinite(f).all()
    return float(energy_force_loss(e, f, b, force_weight=0.01)[0])


def test_mace_trained_by_our_loop_learns(xtb_records):
    from bench.models.molbench import train_for
    from bench.models.molbench_mace import MacePotential
    from convergent.models.molecular import fit_reference_energies

    torch.manual_seed(0)
    ref = fit_reference_energies(xtb_records)
    pot = MacePotential(5.0, ref, xtb_records, hidden_irreps="8x0e+8x1o")
    assert pot.zs == [1, 6, 7, 8] and pot.avg_neighbors > 1.0
    before = _loss(pot, xtb_records)
    info = train_for(pot, xtb_records, budget_cpu_s=600.0, lr=3e-3, batch_atoms=64,
                     force_weight=0.01, max_steps=30)
    assert info["steps"] == 30 and info["diverged_at_step"] is None
    after = _loss(pot, xtb_records)
    assert after < 0.7 * before, (before, after)


def test_mace_forces_are_minus_energy_gradient(xtb_records):
    from bench.models.molbench_mace import MacePotential
    from convergent.models.batching import collate_records
    from convergent.models.molecular import fit_reference_energies

    torch.manual_seed(1)
    ref = fit_reference_energies(xtb_records)
    pot = MacePotential(5.0, ref, xtb_records, dtype=torch.float64, hidden_irreps="8x0e+8x1o")
    rec = xtb_records[1]
    _, f = pot.predict(collate_records([rec], dtype=torch.float64), training=False)
    h = 1e-4
    for atom, axis in ((0, 0), (1, 2), (2, 1)):
        es = []
        for sign in (1, -1):
            r = dict(rec, positions=rec["positions"].copy())
            r["positions"][atom, axis] += sign * h
            e, _ = pot.predict(collate_records([r], dtype=torch.float64), training=False)
            es.append(float(e[0]))
        fd = -(es[0] - es[1]) / (2 * h)
        assert abs(fd - float(f[atom, axis])) < 1e-5 * max(1.0, abs(fd)), (atom, axis, fd, f[atom, axis])


def test_mace_rejects_an_element_outside_its_training_set(xtb_records):
    from bench.models.molbench_mace import MacePotential
    from convergent.models.batching import collate_records
    from convergent.models.molecular import fit_reference_energies

    water = [r for r in xtb_records if r["molecule_id"] == "H2O"]
    pot = MacePotential(5.0, fit_reference_energies(water), water, hidden_irreps="8x0e")
    with pytest.raises(ValueError, match=r"element\(s\) \[6\]"):
        pot.predict(collate_records([xtb_records[4]]), training=False)


def test_importing_mace_leaves_torch_load_safe():
    """mace's import switches torch.load's weights_only off process-wide; ours puts it back."""
    assert os.environ.get(KEY) == ENV_BEFORE
