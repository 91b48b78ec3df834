"""data stats|dedup|filter|split|merge on real datasets, on a 2-worker Dask cluster."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from convergent.analytics.dedup import dedup_dataset
from convergent.analytics.engine import Engine
from convergent.analytics.ops import filter_dataset, merge_datasets
from convergent.analytics.split import split_dataset
from convergent.analytics.stats import compute_stats, write_stats
from convergent.core.errors import ConvergentError
from convergent.data.manifest import read_manifest
from convergent.data.reader import open_dataset
from convergent.data.verify import verify_dataset
from convergent.data.writer import write_records
from tests.analytics.analyticsdata import distinct_records, plant_duplicates, ring_records


def _write(path: Path, recs: list[dict], shard_bytes: int = 8192) -> Path:
    write_records(path, recs, shard_bytes=shard_bytes)
    return path


def _ok(path: Path) -> None:
    rep = verify_dataset(path, deep=True)
    assert rep.ok, rep.problems


def test_stats_on_the_demo_like_dataset(client, demo_like, tmp_path):
    recs = list(open_dataset(demo_like))
    eng = Engine(client, progress=False)
    st = compute_stats(demo_like, eng)
    assert st["records"] == len(recs) == 96
    z = np.concatenate([r["numbers"] for r in recs])
    from convergent.analytics.derived import symbol
    assert st["elements"] == {symbol(int(k)): int(v) for k, v in zip(*np.unique(z, return_counts=True), strict=True)}
    assert st["atoms"] == len(z)
    assert st["label_completeness"]["energy"] == 1.0 and st["label_completeness"]["forces"] == 1.0
    fn = np.concatenate([np.linalg.norm(r["forces"], axis=1) for r in recs])
    assert st["force_norm"]["quantiles"]["p50"] == pytest.approx(np.quantile(fn, 0.5), rel=0.02)
    assert st["force_norm"]["max"] == pytest.approx(fn.max())
    epa = np.array([r["energy"] / len(r["numbers"]) for r in recs])
    assert st["energy_per_atom"]["mean"] == pytest.approx(epa.mean())
    w = (epa.max() - epa.min()) / 2000  # one histogram bin
    e = np.sort(epa)
    assert e[47] - w <= st["energy_per_atom"]["quantiles"]["p50"] <= e[48] + w  # between the middle two
    assert sum(st["atoms_per_structure"]["histogram"].values()) == 96
    # the same code path in one process gives the same numbers
    single = compute_stats(demo_like, Engine(progress=False))
    assert {k: v for k, v in single.items() if k != "tasks_per_worker"} == {
        k: v for k, v in st.items() if k != "tasks_per_worker"}
    figs = write_stats(st, tmp_path / "stats")
    assert len(figs) == 4 and all((tmp_path / "stats" / f).stat().st_size > 1000 for f in figs.values())
    assert json.loads((tmp_path / "stats" / "stats.json").read_text())["records"] == 96


def test_stats_counts_sampler_source_round(tmp_path):
    recs = distinct_records(30)
    ds = _write(tmp_path / "d", recs)
    st = compute_stats(ds)
    assert st["sampler"] == {"md": 20, "opt": 10}
    assert st["round"] == {"0": 15, "1": 15}
    assert st["source"] == {"g2": 30}


def test_dedup_finds_every_planted_duplicate_and_nothing_else(client, tmp_path):
    base = distinct_records(120)
    recs, planted = plant_duplicates(base)
    assert sum(r == "exact" for r, _ in planted.values()) >= 10 and sum(r == "near" for r, _ in planted.values()) >= 10
    src = _write(tmp_path / "src", recs)
    eng = Engine(client, progress=False)
    res = dedup_dataset(src, tmp_path / "kept", tolerance=0.01, engine=eng, shard_bytes=2**20)
    table = [json.loads(x) for x in (tmp_path / "kept" / "dropped.jsonl").read_text().splitlines()]
    found = {t["key"]: (t["reason"], t["duplicate_of"]) for t in table}
    assert found == planted
    kept = open_dataset(tmp_path / "kept")
    assert sorted(kept.keys()) == sorted(r["key"] for r in base)
    assert res["dropped_exact"] + res["dropped_near"] == len(planted)
    _ok(tmp_path / "kept")
    # aggregated I/O: at most one shard per worker at this size, one manifest
    assert len(kept.manifest.shards) <= 2
    assert eng.io["dedup"].files <= 3
    lin = read_manifest(tmp_path / "kept").extra["lineage"]
    assert lin["operation"] == "dedup" and lin["parameters"]["tolerance"] == 0.01
    assert lin["inputs"][0]["path"] == str(src.resolve()) and lin["inputs"][0]["records"] == len(recs)
    # tolerance 0: the rotated copies are no longer duplicates
    res0 = dedup_dataset(src, tmp_path / "exact-only", tolerance=0.0)
    assert res0["dropped_near"] == 0 and res0["dropped_exact"] == res["dropped_exact"]


@pytest.mark.parametrize("on_cluster", [True, False])
def test_dedup_spills_by_partition_and_still_finds_every_duplicate(client, tmp_path, on_cluster):
    """Memory-bounded dedup: many small partitions shuffled through per-worker spill files
    find exactly the planted duplicates (none of the distinct records dropped)."""
    base = distinct_records(200, seed=3)
    recs, planted = plant_duplicates(base, seed=4)
    src = _write(tmp_path / "src", recs, shard_bytes=4096)
    assert len(read_manifest(src).shards) >= 4
    eng = Engine(client if on_cluster else None, progress=False)
    res = dedup_dataset(src, tmp_path / "kept", tolerance=0.01, engine=eng, partition_records=20)
    assert res["partitions"] >= len(recs) // 20
    assert res["largest_partition"] < len(recs)  # no task saw the whole dataset
    assert 1 <= res["spill_files"] <= eng.workers  # one spill file per worker process, not per task
    assert res["spill_bytes"] > len(recs) * 128
    assert not list((tmp_path / "kept").glob(".spill-*"))  # the scratch is gone
    table = [json.loads(x) for x in (tmp_path / "kept" / "dropped.jsonl").read_text().splitlines()]
    assert {t["key"]: (t["reason"], t["duplicate_of"]) for t in table} == planted
    assert sorted(open_dataset(tmp_path / "kept").keys()) == sorted(r["key"] for r in base)
    _ok(tmp_path / "kept")


def test_filter_matches_a_direct_evaluation(client, demo_like, tmp_path):
    where = "max_force < 3 and n_atoms <= 6 and 'H' in elements"
    eng = Engine(client, progress=False)
    res = filter_dataset(demo_like, tmp_path / "f", where, eng)
    want = [r["key"] for r in open_dataset(demo_like)
            if np.linalg.norm(r["forces"], axis=1).max() < 3 and len(r["numbers"]) <= 6 and 1 in r["numbers"]]
    got = open_dataset(tmp_path / "f").keys()
    assert sorted(got) == sorted(want) and 0 < len(want) < 96 and res["kept"] == len(want)
    _ok(tmp_path / "f")
    lin = read_manifest(tmp_path / "f").extra["lineage"]
    assert lin["operation"] == "filter" and lin["parameters"]["where"] == where
    # z-score over the whole input: |z| < 1 keeps a strict, non-empty subset
    res = filter_dataset(demo_like, tmp_path / "z", "abs(e_per_atom_z) < 1")
    assert 0 < res["kept"] < 96


@pytest.mark.parametrize("where, needle", [
    ("max_force <", "not a valid expression"),
    ("__import__('os').system('true')", "can be called"),
    ("[x for x in elements]", "not allowed"),
    ("max_forc < 3", "unknown name 'max_forc'"),
    ("n_atoms.real > 1", "only on meta"),
    ("open('x')", "can be called"),
])
def test_bad_where_is_one_line_exit_2(demo_like, tmp_path, capsys, where, needle):
    from convergent.cli import main

    code = main(["data", "filter", str(demo_like), str(tmp_path / "out"), "--where", where])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[0].startswith("error: --where") and needle in err[0], err
    assert len([x for x in err if x.startswith("error")]) == 1
    assert not (tmp_path / "out").exists()


def test_split_by_scaffold_has_no_leakage(client, tmp_path):
    from rdkit import Chem
    from rdkit.Chem.Scaffolds import MurckoScaffold

    from tests.analytics.analyticsdata import RING_SMILES

    recs = ring_records(frames=4)  # no SMILES in the records: scaffolds from the geometry
    src = _write(tmp_path / "rings", recs, shard_bytes=4096)
    eng = Engine(client, progress=False)
    rep = split_dataset(src, tmp_path / "split", "scaffold", "train=0.6,val=0.2,test=0.2", seed=3, engine=eng)
    assert rep["leakage"]["ok"] and rep["leakage"]["scaffolds_in_two_splits"] == 0
    assert sum(rep["records"].values()) == len(recs)
    truth = {name: Chem.MolToSmiles(MurckoScaffold.GetScaffoldForMol(Chem.MolFromSmiles(s)))
             for name, s in RING_SMILES.items()}
    seen: dict[str, str] = {}
    for split in ("train", "val", "test"):
        for mol in set(open_dataset(tmp_path / "split" / split).molecule_ids()):
            sc = truth[mol] or f"acyclic:{mol}"
            assert seen.setdefault(sc, split) == split, f"scaffold {sc} in {seen[sc]} and {split}"
    # benzene, toluene, phenol share one scaffold: all in one split
    where = {s: set(open_dataset(tmp_path / "split" / s).molecule_ids()) for s in ("train", "val", "test")}
    assert sum(bool({"benzene", "toluene", "phenol"} & m) for m in where.values()) == 1
    for s in ("train", "val", "test"):
        _ok(tmp_path / "split" / s)
        lin = read_manifest(tmp_path / "split" / s).extra["lineage"]
        assert lin["operation"] == "split" and lin["output"] == s and lin["parameters"]["by"] == "scaffold"


def test_split_modes_counts_and_seed(demo_like, tmp_path):
    a = split_dataset(demo_like, tmp_path / "a", "random", "val=10,test=10,train=rest", seed=1)
    assert a["records"] == {"val": 10, "test": 10, "train": 76}
    split_dataset(demo_like, tmp_path / "b", "random", "val=10,test=10,train=rest", seed=1)
    assert open_dataset(tmp_path / "a" / "val").keys() == open_dataset(tmp_path / "b" / "val").keys()
    m = split_dataset(demo_like, tmp_path / "m", "molecule", "train=0.7,val=0.3", seed=0)
    assert m["leakage"]["molecules_in_two_splits"] == 0 and m["leakage"]["ok"]
    c = split_dataset(demo_like, tmp_path / "c", "composition", "train=0.5,val=0.5", seed=0)
    assert c["leakage"]["ok"] and sum(c["records"].values()) == 96
    with pytest.raises(ConvergentError, match="split already exists"):
        split_dataset(demo_like, tmp_path / "a", "random", "val=10,test=10,train=rest")


def test_merge_reshards_and_keeps_provenance(client, demo_like, tmp_path):
    other = _write(tmp_path / "other", distinct_records(40))
    eng = Engine(client, progress=False)
    res = merge_datasets([demo_like, other], tmp_path / "all", eng, shard_bytes=2**20)
    ds = open_dataset(tmp_path / "all")
    assert len(ds) == 136 and res["records"] == 136
    assert sorted(ds.keys()) == sorted(open_dataset(demo_like).keys() + open_dataset(other).keys())
    assert len(ds.manifest.shards) <= 2 < len(read_manifest(other).shards)
    _ok(tmp_path / "all")
    lin = ds.manifest.extra["lineage"]
    assert lin["operation"] == "merge" and [i["path"] for i in lin["inputs"]] == [
        str(demo_like.resolve()), str(other.resolve())]
    # clashing keys: refused, nothing left behind
    with pytest.raises(ConvergentError, match="duplicate record key"):
        merge_datasets([other, other], tmp_path / "twice", eng)
    assert not list((tmp_path / "twice").glob("shard-*")) and not (tmp_path / "twice" / "manifest.json").exists()
    res = merge_datasets([other, other], tmp_path / "twice", eng, prefix_keys=True)
    assert res["records"] == 80 and "1:d0" in open_dataset(tmp_path / "twice").keys()


def test_tasks_run_where_the_cache_holds_their_shard(client, tmp_path):
    from convergent.data.cache import ShardCache

    src = _write(tmp_path / "src", distinct_records(200), shard_bytes=4096)
    m = read_manifest(src)
    template = str(tmp_path / "cache-{worker}")
    names = sorted(str(w["name"]) for w in client.scheduler_info()["workers"].values())
    held = ShardCache(template.replace("{worker}", names[0]))
    for info in m.shards:
        held.get(info, src)  # every shard on worker 0's "node"
    eng = Engine(client, progress=False, cache_dir=template)
    st = compute_stats(src, eng)
    assert st["tasks_per_worker"] == {names[0]: len(m.shards)}
    addr0 = [a for a, w in client.scheduler_info()["workers"].items() if str(w["name"]) == names[0]]
    assert eng.placed == {k: addr0 for k in range(len(m.shards))}
    # without the cache the tasks spread over both workers
    st = compute_stats(src, Engine(client, progress=False))
    assert len(st["tasks_per_worker"]) == 2


def test_existing_output_is_refused_and_kept(demo_like, tmp_path):
    filter_dataset(demo_like, tmp_path / "f", "n_atoms > 3")
    before = (tmp_path / "f" / "manifest.json").read_bytes()
    with pytest.raises(ConvergentError, match="already exists"):
        filter_dataset(demo_like, tmp_path / "f", "n_atoms > 4")
    assert (tmp_path / "f" / "manifest.json").read_bytes() == before
    filter_dataset(demo_like, tmp_path / "f", "n_atoms > 4", overwrite=True)
    _ok(tmp_path / "f")
    with pytest.raises(ConvergentError, match="is an input"):
        filter_dataset(tmp_path / "f", tmp_path / "f", "n_atoms > 5", overwrite=True)
    _ok(tmp_path / "f")
    assert len(list((tmp_path / "f").glob("shard-*"))) == len(read_manifest(tmp_path / "f").shards)


def test_report_includes_dataset_stats(demo_like, tmp_path, capsys):
    from convergent.cli import main
    from convergent.config import ConvergentConfig
    from convergent.monitor.report import build_report
    from convergent.runsdb.rundir import open_run

    run = open_run(ConvergentConfig(), tmp_path / "r")
    assert main(["data", "stats", str(demo_like), "--run", str(run.path), "--single-process", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["records"] == 96 and Path(out["out"]) == run.report / "dataset"
    md = build_report(run.path).read_text()
    assert "## Dataset statistics" in md and "96 / " in md
    for png in ("energy_per_atom.png", "force_norm.png"):
        assert f"](dataset/{png})" in md and (run.report / "dataset" / png).stat().st_size > 1000


def test_a_failing_task_leaves_no_output(client, demo_like, tmp_path):
    from convergent.analytics.where import WhereError

    # valid syntax, but it fails on the workers at the first record (division by zero)
    with pytest.raises(WhereError, match="cannot evaluate on record"):
        filter_dataset(demo_like, tmp_path / "out", "energy / (n_atoms - n_atoms) > 0", Engine(client, progress=False))
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(("shard-", ".shard-"))]
    # an existing output is untouched by a failed overwrite
    filter_dataset(demo_like, tmp_path / "out", "n_atoms > 3")
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    with pytest.raises(WhereError):
        filter_dataset(demo_like, tmp_path / "out", "energy / (n_atoms - n_atoms) > 0",
                       Engine(client, progress=False), overwrite=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
