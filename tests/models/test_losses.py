"""The one energy + force loss: its one-batch form, and its sum form split over parts."""

from __future__ import annotations

import math

import numpy as np
import torch

from convergent.models.batching import collate_records
from convergent.models.losses import (
    energy_force_loss,
    error_sums,
    loss_from_sums,
    metrics_from_sums,
)


def _batch(seed: int = 0, n_mol: int = 6, forces: bool = True):
    rng = np.random.default_rng(seed)
    recs = []
    for _ in range(n_mol):
        n = int(rng.integers(2, 7))
        recs.append({"numbers": rng.integers(1, 9, n), "positions": rng.normal(size=(n, 3)),
                     "energy": float(rng.normal()) * 5,
                     **({"forces": rng.normal(size=(n, 3))} if forces else {})})
    b = collate_records(recs)
    g = torch.Generator().manual_seed(seed)
    e = b.energy + torch.randn(b.n_molecules, generator=g, dtype=torch.float64)
    f = torch.randn(b.num_atoms, 3, generator=g)
    return recs, b, e, f


def test_one_batch_loss_is_the_written_formula():
    _, b, e, f = _batch()
    loss, met = energy_force_loss(e, f, b, force_weight=3.0)
    de = (e - b.energy).numpy()
    n = b.n_atoms.numpy()
    df = (f - b.forces).numpy()
    want = np.mean((de / n) ** 2) + 3.0 * np.mean(df ** 2)
    assert loss.dtype == torch.float32
    assert math.isclose(float(loss), want, rel_tol=1e-5)
    assert math.isclose(met["energy_mae"], np.abs(de).mean(), rel_tol=1e-9)
    assert math.isclose(met["energy_mae_per_atom"], np.abs(de / n).mean(), rel_tol=1e-9)
    assert math.isclose(met["force_mae"], np.abs(df).mean(), rel_tol=1e-6)


def test_sums_over_parts_add_up_to_the_whole_batch():
    recs, b, e, f = _batch(seed=1)
    whole, _ = energy_force_loss(e, f, b, force_weight=2.0)
    parts = ([0, 1, 2], [3, 4, 5])
    total = torch.zeros((), dtype=torch.float32)
    sums: dict[str, float] = {}
    starts = np.cumsum([0, *b.n_atoms.tolist()])
    for idx in parts:
        sub = collate_records([recs[i] for i in idx])
        atoms = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in idx])
        s = error_sums(e[idx], f[atoms], sub)
        total = total + loss_from_sums(s, b.n_molecules, b.num_atoms, 2.0)
        for k, v in s.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    assert math.isclose(float(total), float(whole), rel_tol=1e-5)
    assert math.isclose(metrics_from_sums(sums, 2.0)["loss"], float(whole), rel_tol=1e-5)


def test_no_force_labels_trains_on_energies_and_reports_nan_force_mae():
    _, b, e, f = _batch(seed=2, forces=False)
    loss, met = energy_force_loss(e, f, b, force_weight=10.0)
    de = (e - b.energy) / b.n_atoms
    assert math.isclose(float(loss), float((de ** 2).mean()), rel_tol=1e-6)
    assert math.isnan(met["force_mae"])
    assert float(error_sums(e, f, b)["f_abs"]) == 0.0
