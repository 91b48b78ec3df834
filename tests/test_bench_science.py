"""The science bench's bookkeeping (bench/models/science.py): ours against the best peer
per budget, the summary that model_accuracy[_cpu].json is made of, the xTB RDF reference,
and the presets' sizes. The training and MD it calls are tested in test_bench_sides.py and
test_bench_md.py."""

from __future__ import annotations

import json

import numpy as np

from bench.lib.harness import Result
from bench.models import science


def _result(medians: dict[str, float]) -> Result:
    res = Result("science_accuracy", {}, 1, {}, {k: [{"energy_mae": v}] for k, v in medians.items()})
    res.summarise()
    return res


def test_ours_is_divided_by_the_best_peer_of_each_budget():
    res = _result({"ours@60s": 0.4, "schnet@60s": 0.5, "mace@60s": 0.8,
                   "ours@180s": 0.3, "schnet@180s": 0.6, "mace@180s": 0.25})
    ratio, best = science.vs_best_peer(res, ["ours", "schnet", "mace"], (60.0, 180.0), "energy_mae")
    assert best == {"60s": "schnet", "180s": "mace"}
    assert ratio["60s"] == 0.4 / 0.5 and ratio["180s"] == 0.3 / 0.25


def test_the_summary_carries_each_parts_headline_and_commit(tmp_path):
    (tmp_path / "science_accuracy_cpu.json").write_text(json.dumps({
        "commit": "abc", "device": "cpu", "energy_mae_ratio_vs_best_peer": {"60s": 0.9},
        "best_peer": {"60s": "schnet"}}))
    (tmp_path / "science_md_cpu.json").write_text(json.dumps({
        "commit": "def", "md_stable_fraction": {"ours": {"300K": 1.0}}}))
    out = science.write_summary("cpu", tmp_path)
    assert out["parts"]["accuracy"]["commit"] == "abc" and out["parts"]["md"]["commit"] == "def"
    assert out["energy_mae_ratio_vs_best_peer"] == {"60s": 0.9}
    assert out["md_stable_fraction"]["ours"]["300K"] == 1.0
    assert json.loads((tmp_path / "model_accuracy_cpu.json").read_text()) == out
    assert not (tmp_path / "model_accuracy.json").exists()  # the GPU preset's name


def test_the_rdf_reference_is_the_xtb_frames_of_the_start_compounds_only():
    from bench.models.molbench_md import pair_distance_density, rdf_edges

    edges = rdf_edges()
    water = np.array([[0, 0, 0], [0.96, 0, 0], [-0.24, 0.93, 0]], float)
    far = water * 2.0
    held_out = [{"molecule_id": "w", "kind": "md", "positions": water},
                {"molecule_id": "w", "kind": "conformer", "positions": far},  # not an MD frame
                {"molecule_id": "x", "kind": "md", "positions": far}]  # not a start compound
    g = science.md_reference(held_out, [{"molecule_id": "w"}], edges)
    np.testing.assert_allclose(g, pair_distance_density(water[None], edges))


def test_the_cpu_preset_is_one_seed_and_the_gpu_preset_three():
    assert science.PRESETS["cpu"].seeds == 1 and science.PRESETS["gpu"].seeds == 3
    assert science.PRESETS["gpu"].device == "cuda" and science.PRESETS["gpu"].md_ps == 5.0
    assert len(science.PRESETS["cpu"].budgets) == len(science.PRESETS["gpu"].budgets) == 2


def test_the_balanced_scaffold_split_holds_out_many_scaffolds_never_the_largest():
    from bench.models.nci2k import balanced_scaffold_split

    # one scaffold is 40 % of the records (nci2k's benzene is ~27 %), 60 small ones the rest
    recs = [{"scaffold": "c1ccccc1", "molecule_id": f"b{i}"} for i in range(40)]
    recs += [{"scaffold": f"s{i // 1}", "molecule_id": f"m{i}"} for i in range(60)]
    tr, te = balanced_scaffold_split(recs, 0.2, seed=0)
    held = {recs[i]["scaffold"] for i in te}
    assert len(te) == 20 and len(held) == 20 and "c1ccccc1" not in held
    assert not held & {recs[i]["scaffold"] for i in tr}
    assert balanced_scaffold_split(recs, 0.2, seed=0) == (tr, te)  # seeded
    assert balanced_scaffold_split(recs, 0.2, seed=1)[1] != te
