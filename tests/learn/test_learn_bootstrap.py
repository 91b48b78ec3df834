"""Bagged committee members (learn.members.bootstrap): each trains on its own resample of the labels."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _member(tmp_path: Path, data: Path, name: str, seed: int, bootstrap: bool):
    from convergent.config import ConvergentConfig
    from convergent.learn.tasks import MemberJob, member_config, train_member
    from convergent.models.io import load_model
    from convergent.train.config import TrainConfig

    base = ConvergentConfig.model_validate({"model": {"hidden": 16, "layers": 1, "heads": 2}})
    train = TrainConfig(dataset=str(data), steps=3, lr=1e-3, batch_atoms=256, force_weight=0.1,
                        seed=seed, bootstrap=bootstrap)
    out = tmp_path / name
    summary = train_member(MemberJob(member_config(base, train), str(out)))
    model, _ = load_model(str(out), "cpu")
    return summary, model.atomref.detach().numpy().copy()


def test_bootstrap_members_fit_their_own_resample(tmp_path):
    from tests.train.moldataset import make_dataset

    train, _ = make_dataset(tmp_path / "data", n_train=40, n_val=4)
    s_full, ref_full = _member(tmp_path, train, "full", 5, False)
    s_a, ref_a = _member(tmp_path, train, "a", 5, True)
    s_a2, ref_a2 = _member(tmp_path, train, "a2", 5, True)
    s_b, ref_b = _member(tmp_path, train, "b", 6, True)
    assert s_full["bootstrap"] is False and s_a["bootstrap"] is True
    assert s_a["records"] == s_full["records"] == 40  # a resample of the same size
    # the element references are fitted on the resample: they differ from the full fit
    # and between members of different seeds, and a seed gives the same resample again
    assert not np.allclose(ref_a, ref_full)
    assert not np.allclose(ref_a, ref_b)
    np.testing.assert_array_equal(ref_a, ref_a2)
