"""The nci2k bench dataset (bench/models/nci2k.py): built by convergent's simulation campaign on a
real Dask cluster with real GFN2-xTB (tblite): 3 compounds give labelled conformer and
xTB-MD structures, a rerun reuses the cache, a chunk interrupted after its campaigns ran
is finished without recomputing a record, and scaffold folds never share a scaffold."""

import json
import os

import numpy as np
import pytest

pytest.importorskip("tblite")
pytest.importorskip("rdkit")
from bench.models.nci2k import (
    Nci2kSettings,
    build,
    compounds,
    group_folds,
    load,
    scaffold_group,
    split_report,
)

TINY = Nci2kSettings(max_compounds=3, n_conf=2, md_frames=2, md_interval=3, md_warmup=1,
                     chunk_compounds=2)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The tiny dataset, built once on a one-worker LocalCluster."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from convergent.cluster.config import ClusterConfig
    from convergent.cluster.pool import dask_client

    root = tmp_path_factory.mktemp("nci2k")
    cfg = ClusterConfig(n_workers=1, dashboard_address=None)
    with dask_client(cfg) as client:
        first = build(TINY, root, client=client, progress=False)
        again = build(TINY, root, client=client, progress=False)
        # an interrupted chunk: its campaigns finished but done.json was never written
        (root / "chunk0001" / "done.json").unlink()
        resumed = build(TINY, root, client=client, progress=False)
    return root, first, again, resumed


def test_compounds_filter_and_order():
    comps = compounds(Nci2kSettings())
    assert len(comps) >= 2000  # the dataset's promise
    assert len({c.smiles for c in comps}) == len(comps)
    from rdkit import Chem

    for c in comps[:50]:  # spot check: the filter holds
        m = Chem.AddHs(Chem.MolFromSmiles(c.smiles))
        assert 3 <= m.GetNumAtoms() <= 30
        assert {a.GetSymbol() for a in m.GetAtoms()} <= set("HCNOFS") | {"Cl"}
    assert compounds(TINY) == comps[:3]  # max_compounds takes the first of the same order


def test_build_labels_conformers_and_md_frames(built):
    root, first, _, _ = built
    assert first["chunks_total"] == 2 and first["built"] == [0, 1]
    line = json.loads((root / "build.jsonl").read_text().splitlines()[0])
    assert line["workers_cpu_s"] > 0 and line["md_done"] == line["conformers"] * TINY.md_frames
    recs = load(TINY, root, build_missing=False)
    comps = compounds(TINY)
    assert {r["molecule_id"] for r in recs} == {c.smiles for c in comps}
    for c in comps:
        mine = [r for r in recs if r["cid"] == c.cid]
        conf = [r for r in mine if r["kind"] == "conformer"]
        md = [r for r in mine if r["kind"] == "md"]
        assert len(conf) == TINY.n_conf and len(md) == TINY.n_conf * TINY.md_frames
        assert {r["conformer"] for r in conf} == set(range(TINY.n_conf))
        for r in mine:
            assert r["scaffold"] == c.scaffold
            assert np.isfinite(r["energy"]) and r["forces"].shape == r["positions"].shape
            assert np.all(np.isfinite(r["forces"]))
        # the MD frames moved away from their starting conformer, and xTB sees it
        for r in md:
            start = next(x for x in conf if x["conformer"] == r["conformer"])
            assert np.abs(r["positions"] - start["positions"]).max() > 1e-3
            assert r["energy"] != start["energy"]
        # conformers are distinct embeddings (own seeds), not copies
        assert not np.allclose(conf[0]["positions"], conf[1]["positions"])


def test_rerun_reuses_the_cache(built):
    root, _, again, resumed = built
    assert again["built"] == []  # nothing to do: every chunk has done.json
    assert resumed["built"] == [1]
    last = json.loads((root / "build.jsonl").read_text().splitlines()[-1])
    assert last["chunk"] == 1
    assert last["conf_done"] == 0 and last["md_done"] == 0  # every record was reused
    assert last["conf_skipped"] == last["conformers"]
    assert last["md_skipped"] == last["conformers"] * TINY.md_frames
    keys = [r["key"] for r in load(TINY, root, build_missing=False)]
    assert len(keys) == len(set(keys)) == 3 * TINY.n_conf * (1 + TINY.md_frames)


def test_scaffold_folds_never_share_a_scaffold(built):
    root, *_ = built
    recs = load(TINY, root, build_missing=False)
    # plus synthetic records: three compounds on one ring scaffold, two acyclic ones
    extra = [{"molecule_id": m, "scaffold": s} for m, s in
             [("Cc1ccccc1", "c1ccccc1"), ("Oc1ccccc1", "c1ccccc1"), ("Nc1ccccc1", "c1ccccc1"),
              ("CCO", ""), ("CCN", ""), ("C1CCCCC1O", "C1CCCCC1")] for _ in range(4)]
    recs = recs + extra
    seen_test = []
    for k in range(3):
        tr, te = group_folds(recs, scaffold_group, 3, k, seed=0)
        assert sorted(tr + te) == list(range(len(recs)))
        assert not {scaffold_group(recs[i]) for i in tr} & {scaffold_group(recs[i]) for i in te}
        seen_test += te
    assert sorted(seen_test) == list(range(len(recs)))  # every record tested once
    benz = {k for k in range(3) if any(recs[i]["scaffold"] == "c1ccccc1"
                                       for i in group_folds(recs, scaffold_group, 3, k)[1])}
    assert len(benz) == 1  # all three benzene compounds in one fold
    rep = split_report(recs, 3)
    assert all(f["scaffold_groups_in_train_and_test"] == 0 for f in rep["folds"])
    n_benz = 3 + sum(c.scaffold == "c1ccccc1" for c in compounds(TINY))
    assert rep["largest_scaffold"] == {"scaffold": "c1ccccc1", "compounds": n_benz}


def test_the_benches_folds_of_nci2k_are_scaffold_grouped(built, monkeypatch):
    """molbench_sides.Folds (model_accuracy's and md_stability's data) on the tiny build:
    no scaffold on both sides of any fold, every record tested once, the scaffold counts
    in describe() (the JSON's extra.data)."""
    import argparse

    from bench.models import molbench_sides

    root, *_ = built
    # the tiny build stands in for the default cache (bench/data/nci2k_v1)
    monkeypatch.setattr(molbench_sides, "nci2k_load",
                        lambda chunks: load(TINY, root, chunks=chunks, build_missing=False))
    ap = argparse.ArgumentParser()
    molbench_sides.add_training_args(ap)
    args = ap.parse_args(["--dataset", "nci2k", "--folds", "2", "--data-chunks", "1"])
    molbench_sides.check_data_args(args)  # valid: no exit
    folds = molbench_sides.Folds(args)
    assert {r["cid"] for r in folds.records} == {c.cid for c in compounds(TINY)[:2]}  # chunk 0
    tested = []
    for k in range(2):
        train, test, _ = folds.get(k)
        assert not {scaffold_group(r) for r in train} & {scaffold_group(r) for r in test}
        tested += [r["key"] for r in test]
    assert sorted(tested) == sorted(r["key"] for r in folds.records)
    d = folds.describe("round r = fold r")
    assert d["split"].startswith("scaffold-grouped 2-fold") and d["data_chunks"] == 1
    assert d["scaffolds"]["compounds"] == 2 and len(d["scaffolds"]["folds"]) == 2
    assert all(f["scaffold_groups_in_train_and_test"] == 0 for f in d["scaffolds"]["folds"])


@pytest.mark.parametrize("flags", [["--dataset", "nci", "--data-chunks", "2"],
                                   ["--dataset", "nci2k", "--data-chunks", "0"]])
def test_bad_data_chunks_exit_2_with_one_line(flags, tmp_path):
    import subprocess

    from bench.lib.paths import child_env, module_argv

    for script in ("bench.models.accuracy", "bench.models.md_stability"):
        p = subprocess.run([*module_argv(script), *flags, "--out", str(tmp_path / "x.json")],
                           capture_output=True, text=True, timeout=300, env=child_env())
        assert p.returncode == 2, (script, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "--data-chunks" in lines[0], (script, p.stderr)
    assert not (tmp_path / "x.json").exists()
