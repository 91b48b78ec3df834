"""bench/learn/retrospective*.py on 60 EMT-labelled structures with made-up scaffold groups:
every strategy's campaign runs two rounds of selection through learn's real code, a label
leaves the LabelOracle only for a selected structure, no held-out scaffold enters the pool,
and the rules' hash follows every rule."""

from __future__ import annotations

import dataclasses
import subprocess

import numpy as np
import pytest
import torch

from bench.learn.retrospective import median_ratio, per_seed, reach
from bench.learn.retrospective_campaign import run_campaign
from bench.learn.retrospective_data import LabelOracle, candidate, make_split
from bench.learn.retrospective_rules import PRESETS, STRATEGIES, Rules, rules_hash, with_overrides
from bench.lib.paths import child_env, module_argv
from bench.models.nci2k import scaffold_group

NAMES = ["CH4", "NH3", "H2O", "C2H6", "CH3OH", "C2H4", "HCN", "CH3CN", "H2CO", "C2H2"]
# molecule -> scaffold ('' = acyclic, its own group); two molecules share "ring-a"
SCAFFOLD = {"C2H6": "ring-a", "C2H4": "ring-a", "CH3OH": "ring-b", "CH3CN": "ring-c"}


@pytest.fixture(scope="module")
def records():
    from ase.build import molecule
    from ase.calculators.emt import EMT

    rng = np.random.default_rng(0)
    out = []
    for name in NAMES:
        for k in range(6):
            atoms = molecule(name)
            atoms.positions += rng.normal(0.0, 0.15, atoms.positions.shape)
            atoms.calc = EMT()
            out.append({"key": f"{name}/{k}", "molecule_id": name, "scaffold": SCAFFOLD.get(name, ""),
                        "kind": "md" if k % 2 else "conformer",
                        "numbers": atoms.numbers.astype(np.int64), "positions": atoms.positions.copy(),
                        "energy": float(atoms.get_potential_energy()),
                        "forces": np.asarray(atoms.get_forces(), np.float64)})
    return sorted(out, key=lambda r: r["key"])


RULES = Rules(preset="test", seeds=(0,), test_fraction=0.3, test_structures=0, pool_compounds=0,
              candidates=0, init=6, batch=5, budget=16, committee=2, first_round_steps=3, steps=2,
              hidden=8, layers=1, heads=2, batch_atoms=64, predict_batch_atoms=256)


def test_split_keeps_held_out_scaffolds_out_of_the_pool(records):
    for seed in range(4):
        split = make_split(records, RULES, seed)
        pool = {scaffold_group(records[i]) for i in split.pool}
        test = {scaffold_group(records[i]) for i in split.test}
        assert split.test and split.pool and not pool & test
        assert sorted(split.pool + split.test) == list(range(len(records)))
    sample = make_split(records, dataclasses.replace(RULES, pool_compounds=3, test_structures=5), 0)
    assert len({records[i]["molecule_id"] for i in sample.pool}) == 3 and len(sample.test) == 5


def test_label_oracle_reveals_each_structure_once(records):
    cands = [candidate(r) for r in records[:4]]
    assert all(not {"energy", "forces"} & c.record().keys() for c in cands)
    oracle = LabelOracle(records[:4])
    got = oracle.reveal([2, 0], cands)
    assert [r["key"] for r in got] == [records[2]["key"], records[0]["key"]]
    assert got[0]["energy"] == records[2]["energy"] and oracle.revealed == [2, 0]
    with pytest.raises(ValueError):
        oracle.reveal([0], cands)
    oracle.true_energy([3])
    assert oracle.revealed == [2, 0] and oracle.peeked == {3}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_campaign_reveals_only_what_it_selects(records, strategy, tmp_path):
    from convergent.data.reader import open_dataset

    out = run_campaign(records, RULES, strategy, 0, tmp_path)
    split = make_split(records, RULES, 0)
    pool = {records[i]["key"] for i in split.pool}
    test = {records[i]["key"] for i in split.test}
    assert len(out["curve"]) >= 3 and len(out["rounds"]) >= 2  # two rounds of selection
    assert [p["labels"] for p in out["curve"]] == sorted(p["labels"] for p in out["curve"])
    assert out["labels"] <= RULES.budget and len(out["selected"][0]) == RULES.init
    assert out["revealed"] == [k for batch in out["selected"] for k in batch]
    assert len(set(out["revealed"])) == len(out["revealed"]) and set(out["revealed"]) <= pool
    assert not set(out["revealed"]) & test
    last = sorted(tmp_path.glob("labels-r*"))[-1]
    ds = open_dataset(last)
    try:
        assert set(ds.keys()) == set(out["revealed"])  # trained on exactly the revealed labels
    finally:
        ds.close()
    assert (out["oracle_peeked"] > 0) == (strategy == "oracle")
    assert all(np.isfinite(p["energy_mae_per_atom"]) and np.isfinite(p["force_mae"]) for p in out["curve"])


def test_rules_hash_follows_every_rule():
    h = rules_hash(RULES)
    assert rules_hash(dataclasses.replace(RULES)) == h
    assert rules_hash(dataclasses.replace(RULES, batch=6)) != h
    ours = tuple(sorted({**dict(RULES.ours), "labelled_tol": 0.3}.items()))
    assert rules_hash(dataclasses.replace(RULES, ours=ours)) != h
    assert rules_hash(with_overrides(RULES, ["steps=3"], None)) != h
    assert with_overrides(RULES, [], [0, 1]).seeds == (0, 1)
    with pytest.raises(ValueError):
        with_overrides(RULES, ["ours=x"], None)
    assert len({rules_hash(r) for r in PRESETS.values()}) == len(PRESETS)
    assert dict(PRESETS["cpu"].ours)["acquisition"] == "posterior"


def test_ratio_interpolates_along_the_curve():
    def curve(ys):
        return [{"labels": 10 * (i + 1), "energy_mae_per_atom": y, "force_mae": y} for i, y in enumerate(ys)]

    camps = {("random", 0): {"curve": curve([4, 3, 2, 1])}, ("ours", 0): {"curve": curve([4, 2, 1, 0.5])},
             ("random", 1): {"curve": curve([4, 3, 2, 1])}, ("ours", 1): {"curve": curve([4, 4, 4, 4])}}
    assert reach(camps[("ours", 0)]["curve"], "force_mae", 1.5) == 25.0
    rows = per_seed(camps, [0, 1], "ours", "energy_mae_per_atom")
    assert [r["ratio"] for r in rows] == [0.75, None] and all(r["random_improved"] for r in rows)
    assert median_ratio(rows) is None and median_ratio(rows[:1]) == 0.75


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_gpu_entry_needs_cuda_and_exits_2(tmp_path):
    out = tmp_path / "al.json"
    p = subprocess.run([*module_argv("bench.gpu.al"), "--out", str(out)], capture_output=True,
                       text=True, env=child_env(CUDA_VISIBLE_DEVICES=""), timeout=120)
    assert p.returncode == 2 and not out.exists()
    assert p.stderr.strip().splitlines() == [
        "bench/gpu/al.py needs a CUDA GPU (torch.cuda.is_available() is False)"]
