"""MACE as the active-learning committee (issue 40 item 1), on real xTB labels: members
trained by learn's train task with model.kind=mace, then every other committee task —
scoring with the spread, batched exploration MD driven by the committee's mean, held-out
evaluation — loads and runs them as MACE."""

from __future__ import annotations

import numpy as np
import pytest

from convergent.models.mace import mace_installed

pytestmark = pytest.mark.skipif(not mace_installed(),
                                reason="mace-torch not installed (pip install 'convergent[mace]')")
NAMES = ["H2O", "CH4", "NH3", "CH3OH", "C2H6", "H2CO"]


def _xtb_dataset(path, n_per: int = 4):
    """GFN2-xTB labels (tblite) of rattled small G2 molecules, as learn's label task makes them."""
    from ase.build import molecule

    from convergent.data.writer import write_records
    from convergent.learn.tasks import label_items
    from convergent.sim.calculators import CalcSpec
    from convergent.sim.config import SimulateConfig

    rng = np.random.default_rng(0)
    items = []
    for name in NAMES:
        a = molecule(name)
        for k in range(n_per):
            items.append({"key": f"{name}/{k}", "molecule_id": name, "numbers": a.numbers,
                          "positions": a.positions + rng.normal(0, 0.05, a.positions.shape),
                          "charge": 0, "multiplicity": 1, "meta": {}})
    res = label_items(items, CalcSpec.from_simulate(SimulateConfig()).to_dict(), 0.5)
    assert len(res.records) == len(items)
    write_records(path, res.records)
    return path, res.records


def test_a_mace_committee_trains_scores_explores_and_evaluates(tmp_path):
    from convergent.config import load_config
    from convergent.learn.config import LEARN_PRESET
    from convergent.learn.tasks import (
        MemberJob,
        evaluate,
        explore_md,
        member_config,
        score_records,
        train_member,
    )
    from convergent.models.io import load_model
    from convergent.models.mace import MaceModel

    data, recs = _xtb_dataset(tmp_path / "labels")
    cfg = load_config(None, ["model.kind=mace", "model.mace.channels=8", "model.mace.correlation=2",
                             "model.mace.max_ell=2", "model.mace.radial_mlp=[16,16]"],
                      preset=LEARN_PRESET)
    members = []
    for k in range(2):
        train = cfg.train.model_copy(update={"dataset": str(data), "steps": 8, "seed": k})
        out = tmp_path / f"m{k}"
        summary = train_member(MemberJob(member_config(cfg, train), str(out)))
        assert summary["steps"] == 8
        assert isinstance(load_model(out)[0], MaceModel)
        members.append(str(out))
    # scoring: the two members disagree (different seeds), finitely
    s = score_records(members, recs[:6], 256)
    assert np.all(np.isfinite(s["energy_std"])) and max(s["energy_std"]) > 0
    # exploration: batched MD on the committee's mean from two starts
    starts = [{"numbers": r["numbers"], "positions": r["positions"]} for r in recs[:8:4]]
    frames = explore_md(members, starts, steps=10, interval=5, temperature=300.0,
                        timestep_fs=0.5, friction=0.02, seeds=[1, 2])
    assert len(frames) == 2 and all(f["step"] in (5, 10) for fr in frames for f in fr)
    # evaluation on the labels
    err = evaluate(members, str(data), 256)
    assert np.isfinite(err["energy_mae"]) and np.isfinite(err["force_mae"])
