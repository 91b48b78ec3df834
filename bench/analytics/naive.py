"""The peer of bench/analytics/commands.py: a plain dask.bag version of `stats`, `dedup` and `split`
(records as a bag of dicts, ``groupby`` for dedup, one output shard file per partition)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _naive_records(task) -> list[dict]:
    from convergent.data.reader import ShardReader

    rd = ShardReader(Path(task.dataset), task.info)
    return [rd.record(i) for i in range(task.info.records)]


def _naive_feat(r: dict) -> dict:
    from convergent.analytics import derived

    fn = derived.force_norms(r)
    n = len(r["numbers"])
    return {"z": np.bincount(r["numbers"], minlength=256), "n": n, "epa": r["energy"] / n,
            "fn": fn, "sampler": r["meta"].get("sampler"), "round": r["meta"].get("round")}


def _naive_stats(bag):
    def part(rs):
        rs = list(rs)
        z = np.sum([r["z"] for r in rs], axis=0) if rs else np.zeros(256)
        fn = np.concatenate([r["fn"] for r in rs]) if rs else np.zeros(0)
        return {"z": z, "n": [r["n"] for r in rs], "epa": [r["epa"] for r in rs], "fn": fn,
                "sampler": [r["sampler"] for r in rs], "round": [r["round"] for r in rs]}

    def agg(ps):
        ps = list(ps)
        fn = np.concatenate([p["fn"] for p in ps])
        epa = np.concatenate([p["epa"] for p in ps])
        return {"elements": np.sum([p["z"] for p in ps], axis=0).tolist(),
                "epa_q": np.quantile(epa, [0.01, 0.5, 0.99]).tolist(),
                "fn_q": np.quantile(fn, [0.01, 0.5, 0.99]).tolist()}

    return bag.map(_naive_feat).reduction(part, agg, split_every=10**6)


def _naive_write(rs, out: str, run: str, schema: str, compression: str):
    """One shard file per partition (the naive output)."""
    import secrets

    from convergent.data.writer import DatasetWriter

    rs = list(rs)
    if not rs:
        return []
    w = DatasetWriter(out, schema=schema, compression=compression, commit=False, check_unique=False,
                      tag=f"{run}{secrets.token_hex(3)}", shard_bytes=2**40)
    w.write_many(rs)
    w.flush()
    return [vars(s) for s in w.new_shards]


def _fp_row(r: dict) -> tuple:
    from convergent.analytics import derived

    return (derived.composition_hash(r), r["key"], derived.structure_hash(r),
            derived.fingerprint(r["numbers"], r["positions"]).astype(np.float32), len(r["numbers"]))


def _naive_group_dups(item, tol: float) -> list[str]:
    """Dropped keys of one composition group (the same vectorised match as the engine)."""
    from convergent.analytics.dedup import ROW, match_rows

    _, rows = item
    rows = sorted(rows, key=lambda r: r[1])  # keep the lowest key, like the engine keeps the lowest index
    piece = np.zeros(len(rows), ROW)
    piece["idx"] = np.arange(len(rows))
    piece["hash"] = [r[2] for r in rows]
    piece["comp"] = [r[0] for r in rows]
    piece["fp"] = np.stack([r[3] for r in rows])
    piece["n"] = [r[4] for r in rows]
    return [rows[int(i)][1] for i in match_rows(piece, tol)["drop"]]


def run_naive(cmd: str, src: Path, out: Path, client, partitions: int, tol: float) -> None:
    import dask.bag as db

    from convergent.analytics.engine import plan
    from convergent.data.parallel import merge_parts

    tasks, (m,) = plan([src])
    bag = db.from_sequence(tasks, npartitions=len(tasks)).map(_naive_records).flatten()
    bag = bag.repartition(npartitions=partitions)
    run = "naive"
    if cmd == "stats":
        res = _naive_stats(bag).compute()
        out.mkdir(parents=True, exist_ok=True)
        (out / "stats.json").write_text(json.dumps(res))
        return
    if cmd == "dedup":
        groups = bag.map(_fp_row).groupby(lambda t: t[0])
        dropped = set(groups.map(_naive_group_dups, tol).flatten().compute())
        kept = bag.filter(lambda r, d=frozenset(dropped): r["key"] not in d)
        parts = kept.map_partitions(_naive_write, str(out), run, m.schema, m.compression).compute()
        merge_parts(out, [parts], m.schema, m.compression, overwrite=True)
        return
    # split by molecule, 80/10/10, seeded: one file per partition per split
    mols = sorted(bag.map(lambda r: r["molecule_id"]).distinct().compute())
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(mols))
    cut = np.cumsum([0, round(0.8 * len(mols)), round(0.1 * len(mols))])
    where = {}
    for s, name in enumerate(("train", "val", "test")):
        hi = cut[s + 1] if s < 2 else len(mols)
        for k in perm[cut[s]: hi]:
            where[mols[k]] = name
    for name in ("train", "val", "test"):
        sub = bag.filter(lambda r, n=name, w=where: w[r["molecule_id"]] == n)
        parts = sub.map_partitions(_naive_write, str(out / name), run, m.schema, m.compression).compute()
        merge_parts(out / name, [parts], m.schema, m.compression, overwrite=True)
