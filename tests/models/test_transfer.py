"""Transfer-learning helpers: freezing, param groups, schedule, reference refit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase.build import molecule

from convergent.models.batching import atoms_to_record, collate_records
from convergent.models.config import ModelConfig
from convergent.models.molecular import build_model, energy_and_forces
from convergent.models.transfer import FinetuneConfig, freeze, lr_factor, prepare_finetune


def test_freeze_modes():
    m = build_model(ModelConfig(hidden=16, layers=3))
    frozen = freeze(m, "backbone")
    assert frozen and all(n.startswith(("embedding.", "layers.")) for n in frozen)
    assert all(p.requires_grad for n, p in m.named_parameters() if n.startswith("energy_head."))
    freeze(m, "layers:2")
    assert not m.layers[1].qkv.weight.requires_grad and m.layers[2].qkv.weight.requires_grad
    freeze(m, "none")
    assert all(p.requires_grad for p in m.parameters())
    with pytest.raises(ValueError):
        freeze(m, "everything")


def test_lr_schedule_shape():
    f = [lr_factor(s, 100, 10, "cosine") for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:], strict=False))
    assert f[-1] < 0.01
    assert lr_factor(50, 100, 0, "linear") == pytest.approx(0.5)


def test_prepare_finetune_refits_offsets_and_trains_only_unfrozen():
    torch.manual_seed(0)
    m = build_model(ModelConfig(hidden=16, layers=2))
    recs = []
    for i, name in enumerate(["H2O", "CH4", "NH3", "CH3OH", "C2H6"]):
        a = molecule(name)
        r = atoms_to_record(a, str(i))
        # "new level of theory": large per-element offsets
        r["energy"] = float(sum({1: -13.0, 6: -1030.0, 7: -1480.0, 8: -2040.0}[int(z)] for z in a.numbers))
        r["forces"] = np.zeros((len(a), 3))
        recs.append(r)
    emb_before = m.embedding.weight.detach().clone()
    opt, sched = prepare_finetune(m, recs, FinetuneConfig(freeze="embedding", warmup_steps=2), 10)
    b = collate_records(recs)
    e0, _ = energy_and_forces(m, b, training=False)
    assert np.abs(e0.numpy() - b.energy.numpy()).max() < 5.0  # offsets absorbed (was ~1e3)
    for _ in range(3):
        e, f = energy_and_forces(m, b, training=True)
        loss = ((e - b.energy) ** 2).mean() + (f ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    assert torch.equal(m.embedding.weight, emb_before)
    assert [g["name"] for g in opt.param_groups] == ["head", "backbone"]
