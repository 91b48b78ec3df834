"""The DFT subset of nci2k (bench/models/nci2k_dft.py): the selection under the atom cut
and the held-out-scaffold split are deterministic, spread over scaffolds, and never put a
scaffold group on both sides; the cost fit and the cut rule. Synthetic records, no DFT."""

import numpy as np
import pytest

from bench.models.nci2k import scaffold_group
from bench.models.nci2k_dft import DftSettings, choose_cut, fit_cost, select, selection, split


def _records(n_compounds: int = 40, per_compound: int = 6) -> list[dict]:
    """Compounds of 5..16 atoms on 8 ring scaffolds or acyclic, a few structures each."""
    rng = np.random.default_rng(7)
    recs = []
    for c in range(n_compounds):
        n_atoms = 5 + c % 12
        scaffold = "" if c % 3 == 0 else f"ring{c % 8}"
        for k in range(per_compound):
            recs.append({"key": f"nci2k-{c:04d}/s0/{k:05d}", "molecule_id": f"smi{c}",
                         "cid": f"nci2k-{c:04d}", "scaffold": scaffold,
                         "kind": "conformer" if k < 2 else "md", "conformer": k % 2,
                         "numbers": np.ones(n_atoms, np.int64),
                         "positions": rng.normal(size=(n_atoms, 3)), "energy": -float(c)})
    return recs


def test_select_is_deterministic_and_under_the_cut():
    recs = _records()
    a = select(recs, 12, 60, seed=0)
    b = select(list(reversed(recs)), 12, 60, seed=0)  # input order does not matter
    assert [r["key"] for r in a] == [r["key"] for r in b]
    assert len(a) == 60 and len({r["key"] for r in a}) == 60
    assert all(len(r["numbers"]) <= 12 for r in a)
    assert [r["key"] for r in select(recs, 12, 60, seed=1)] != [r["key"] for r in a]


def test_select_spreads_over_scaffold_groups():
    recs = _records()
    sel = select(recs, 16, 50, seed=0)
    groups = {scaffold_group(r) for r in recs}
    counts = [sum(scaffold_group(r) == g for r in sel) for g in groups]
    assert max(counts) - min(counts) <= 1  # round-robin over groups
    assert len({scaffold_group(r) for r in sel}) == len(groups)


def test_split_disjoint_scaffolds_and_deterministic():
    recs = _records()
    settings = DftSettings(max_atoms=14, n_structures=80)
    sel = selection(settings, recs)
    again = selection(settings, list(reversed(recs)))
    assert [(r["key"], r["split"]) for r in sel] == [(r["key"], r["split"]) for r in again]
    train = {scaffold_group(r) for r in sel if r["split"] == "train"}
    test = {scaffold_group(r) for r in sel if r["split"] == "test"}
    assert train and test and not train & test
    tr, te = split(sel, settings)
    assert sorted(tr + te) == list(range(len(sel)))
    assert 0.1 < len(te) / len(sel) < 0.35


def test_cost_fit_and_cut():
    atoms = [5, 8, 10, 12]
    cost = fit_cost(atoms, [0.01 * n**3 for n in atoms])
    assert cost["b"] == pytest.approx(3.0) and cost["a"] == pytest.approx(0.01)
    recs = _records()
    settings = DftSettings(n_structures=50, workers=2, budget_s=150.0)
    cut, rows = choose_cut(recs, cost, settings)
    chosen = next(r for r in rows if r["max_atoms"] == cut)
    assert chosen["fits"] and chosen["predicted_wall_s"] <= 150.0
    assert any(not r["fits"] for r in rows if r["max_atoms"] > cut)  # the budget binds
    assert not any(r["fits"] for r in rows if r["max_atoms"] > cut)


def test_transfer_subsets_nested_and_cover_every_element():
    from bench.models.transfer_sides import nested_order, pretrain_records, validation_split

    recs = _records()
    recs[17]["numbers"] = np.array([17, 1, 6, 1, 1], np.int64)  # the one chlorine structure
    order = nested_order(recs, seed=3)
    assert order == nested_order(recs, seed=3) and sorted(order) == list(range(len(recs)))
    first = {int(z) for i in order[:2] for z in recs[i]["numbers"]}
    assert first == {1, 6, 17}  # the smallest subsets already know every element
    fit, val = validation_split(recs)
    assert not {scaffold_group(r) for r in fit} & {scaffold_group(r) for r in val}
    test = [r for r in recs if scaffold_group(r) == "ring1"]
    assert all(scaffold_group(r) != "ring1" for r in pretrain_records(recs, test))
