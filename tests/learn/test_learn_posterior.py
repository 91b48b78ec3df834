"""Last-layer features of a real committee (learn.select.acquisition=posterior) and selection on them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.learn.picking import pick


@pytest.mark.numerics
def test_committee_features_are_the_energy_heads_last_layer_and_the_element_fractions(tmp_path):
    from convergent.config import ConvergentConfig
    from convergent.data.reader import open_dataset
    from convergent.learn.pool import Candidate
    from convergent.learn.tasks import (
        MemberJob,
        _models,
        member_config,
        score_records,
        train_member,
    )
    from convergent.train.config import TrainConfig
    from tests.train.moldataset import make_dataset

    train, _ = make_dataset(tmp_path / "data", n_train=24, n_val=4)
    # no repulsive prior: the per-atom energies below are then the head's alone
    base = ConvergentConfig.model_validate(
        {"model": {"hidden": 16, "layers": 1, "heads": 2, "repulsion": "none"}})
    dirs = []
    for k in range(2):
        out = tmp_path / f"m{k}"
        t = TrainConfig(dataset=str(train), steps=3, lr=1e-3, batch_atoms=256, force_weight=0.1,
                        seed=k)
        train_member(MemberJob(member_config(base, t), str(out)))
        dirs.append(str(out))
    ds = open_dataset(train)
    recs = [ds[i] for i in range(len(ds))]
    ds.close()
    elements = [1, 6, 7, 8]
    # scored in chunks of different atom budgets: the same rows either way
    a = score_records(dirs, recs, 64, elements=elements)
    b = score_records(dirs, recs, 4096, elements=elements)
    fa, fb = np.asarray(a["features"]), np.asarray(b["features"])
    assert fa.shape == (len(recs), 2 * 8 + 4)  # two members' hidden // 2 activations, 4 elements
    np.testing.assert_allclose(fa, fb, rtol=1e-5, atol=1e-6)
    z0 = np.asarray(recs[0]["numbers"])
    np.testing.assert_allclose(fa[0, -4:], [(z0 == e).mean() for e in elements])
    assert not np.allclose(fa[:, :8], fa[:, 8:16])  # each member has its own representation
    # the features are what the head's last linear layer reads: it reproduces the energies
    (model,) = _models(dirs[:1], "cpu")
    head = model.energy_head[len(model.energy_head) - 1]
    assert not model.energy_head[len(model.energy_head) - 2]._forward_hooks  # hook removed
    w = head.weight.detach().double().numpy().ravel()
    from convergent.models.batching import collate_records

    for i in (0, 5):
        z = torch.as_tensor(np.asarray(recs[i]["numbers"]))
        with torch.no_grad():
            _, atom_e = model(collate_records([recs[i]]), per_atom=True)
        eps = (atom_e - model.atomref[z].double() - float(model.shift)) / float(model.scale)
        np.testing.assert_allclose(fa[i, :8] @ w + float(head.bias.detach()), float(eps.mean()), rtol=1e-4,
                                   atol=1e-5)
    # and a posterior batch runs on them, under the rules
    cands = [Candidate.make(r["molecule_id"], r["numbers"], r["positions"]) for r in recs]
    picked = pick(cands[8:], np.asarray(a["energy_std"])[8:], 4, tol=0.0, max_per_molecule=1,
                          acquisition="posterior", features=(fa[8:], fa[:8]), alpha=0.0, gain="pool")
    assert len(picked) == len({cands[8 + i].molecule_id for i in picked}) == min(
        4, len({c.molecule_id for c in cands[8:]}))
