"""Dataset analytics benchmark: `stats`, `dedup`, `split` on a generated 1,000,000-record set.

Three sides run the same work on the same dataset:

* ``dask``   convergent.analytics on a LocalCluster of ``--workers`` single-threaded
             worker processes (per-shard tasks, per-worker sinks, one manifest commit);
* ``single`` the same code path in one process (``Engine(client=None)``);
* ``naive``  a plain dask.bag version on the same cluster: records as a bag of dicts,
             ``groupby`` for dedup, one output shard file per partition (and split);
* ``ideal``  the machine's ceiling for 2-way parallelism of this work: two ``single``
             processes at once, each on its own half of the shards (no scheduler, no
             coordination, no shared output); its wall time is the slower half's. Against
             ``single`` it measures what two busy cores give on this machine (shared caches,
             memory bandwidth, the host's share of the cores, one disk). For dedup the halves
             do less than the whole (no pairs across halves): a bound, not the same work.

Each measurement runs in a fresh subprocess (fresh cluster) so its peak RSS is its own;
``dask``, ``single`` and ``ideal`` are interleaved within each round (bench/lib/harness.py,
``--rounds``); ``naive``, several times slower, runs ``--naive-rounds`` interleaved rounds
of its own after them (its ratio is a floor of 1.5, not a close call). Medians over rounds
are reported with their spread (min/max/IQR). Files and bytes written per stage are
counted from the output directories; dedup's spill files (its disk-backed shuffle) are
reported as intermediate files and bytes. Peak RSS per worker is measured at two dataset
sizes (a quarter of the dataset, the same shards, and the whole) to show it does not grow.

    python -m bench.analytics.commands                 # generate (cached in bench/data/) and run
    python -m bench.analytics.commands --records 100000 --rounds 1 --allow-dirty  # a quick look

Writes ``bench/results/analytics.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import numpy as np

from bench.analytics import naive as analytics_naive
from bench.analytics.naive import run_naive
from bench.lib import paths
from bench.lib.harness import Side, add_args, check_clean, interleave, write_result

# the naive side's functions travel to the workers by value (they need not import bench)
cloudpickle.register_pickle_by_value(analytics_naive)

DATA = paths.DATA
RESULTS = paths.RESULTS / "analytics.json"
COMMANDS = ("stats", "dedup", "split")
SIDES = ("dask", "single", "naive", "ideal")
PAIRED = ("dask", "single", "ideal")  # interleaved in the main rounds; naive in rounds of its own
ELEMENTS = np.array([1, 6, 7, 8])
SHARD_BYTES = 2**30  # output shards roll at 1 GiB: one shard per worker and output at this size


# --------------------------------------------------------------------------- data


def _molecules(n_mol: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out, seen = [], set()
    while len(out) < n_mol:
        n = int(rng.integers(5, 31))
        z = rng.choice(ELEMENTS, size=n, p=[0.5, 0.3, 0.1, 0.1])
        pos = rng.normal(scale=0.9 * n ** (1 / 3), size=(n, 3))
        f = tuple(np.bincount(z, minlength=9).tolist())
        if f in seen:  # one formula per molecule: split's chemistry check sees distinct molecules
            continue
        seen.add(f)
        out.append((z.astype(np.int64), pos))
    return out


def _part(k: int, per: int, n_mol: int, seed: int) -> list[dict]:
    """Records k*per .. (k+1)*per - 1: MD frames of a pool of molecules, with ~1 % exact
    and ~1 % near duplicates planted, meta like a simulation campaign's."""
    mols = _molecules(n_mol, seed)
    rng = np.random.default_rng([seed, k])
    recs = []
    for i in range(k * per, (k + 1) * per):
        m = int(rng.integers(n_mol))
        z, base = mols[m]
        u = rng.random()
        if u < 0.01 and recs:  # exact duplicate of an earlier record of this part
            src = recs[int(rng.integers(len(recs)))]
            recs.append(dict(src, key=f"r{i:07d}"))
            continue
        if u < 0.02 and recs:  # near duplicate: jittered by 1e-4 Å
            src = recs[int(rng.integers(len(recs)))]
            recs.append(dict(src, key=f"r{i:07d}", positions=src["positions"] + rng.uniform(-1e-4, 1e-4, src["positions"].shape)))
            continue
        pos = base + rng.normal(scale=0.05, size=base.shape)
        n = len(z)
        recs.append({
            "key": f"r{i:07d}", "molecule_id": f"mol{m:05d}", "numbers": z, "positions": pos,
            "energy": float(-4.5 * n + rng.normal(scale=0.3)), "forces": rng.normal(scale=1.0, size=(n, 3)),
            "charge": 0, "multiplicity": 1,
            "meta": {"program": "xtb", "method": "GFN2-xTB", "wall_s": round(float(rng.uniform(0.05, 0.4)), 6),
                     "host": f"node{int(rng.integers(4)):02d}", "sampler": "md" if u < 0.9 else "opt",
                     "temperature": 300.0, "replica": int(rng.integers(4)), "step": int(rng.integers(1000)),
                     "timestep_fs": 0.5, "friction": 0.01, "seed": seed, "origin": f"g2:mol{m:05d}",
                     "round": int(rng.integers(3))},
        })
    return recs


def generate(path: Path, records: int, shard_mib: int, seed: int = 0) -> None:
    """Write the dataset with the parallel writer on 2 local workers (cached)."""
    from dask.distributed import Client, LocalCluster

    from convergent.data.parallel import write_parallel

    per = 10_000
    parts = -(-records // per)
    n_mol = max(10, records // 500)
    import functools

    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cl, Client(cl) as c:
        write_parallel([functools.partial(_part, k, per, n_mol, seed) for k in range(parts)], path,
                       shard_bytes=shard_mib * 2**20, client=c, overwrite=True)


def subset(src: Path, dst: Path, fraction: float) -> None:
    """A dataset of the first ``fraction`` of ``src``'s shards (symlinked, own manifest)."""
    from convergent.data.manifest import read_manifest

    shards = read_manifest(src).shards
    _link(src, dst, slice(0, max(1, round(len(shards) * fraction))))


def halves(src: Path) -> list[Path]:
    """Two datasets of the first and second half of ``src``'s shards (symlinked)."""
    from convergent.data.manifest import read_manifest

    k = len(read_manifest(src).shards) // 2
    out = [DATA / f"{src.name}-half{j}" for j in (0, 1)]
    _link(src, out[0], slice(0, k))
    _link(src, out[1], slice(k, None))
    return out


def _link(src: Path, dst: Path, part: slice) -> None:
    """``dst``: the shards ``part`` of ``src`` symlinked, with their own manifest."""
    from convergent.data.manifest import Manifest, read_manifest, write_manifest

    m = read_manifest(src)
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for s in m.shards[part]:
        (dst / s.name).symlink_to(src.resolve() / s.name)
    write_manifest(dst, Manifest(schema=m.schema, compression=m.compression, shards=m.shards[part]))


# --------------------------------------------------------------------------- one measurement


def _io(out: Path) -> tuple[int, int, int]:
    """(files, bytes, most files in one output dataset directory)."""
    files = [p for p in out.rglob("*") if p.is_file()]
    per_dir: dict[Path, int] = {}
    for p in files:
        per_dir[p.parent] = per_dir.get(p.parent, 0) + 1
    return len(files), sum(p.stat().st_size for p in files), max(per_dir.values(), default=0)


def measure(side: str, cmd: str, src: Path, out: Path, workers: int, tol: float, naive_parts: int) -> dict:
    """Run one (side, command) in this process; returns its numbers."""
    from convergent.analytics.dedup import dedup_dataset
    from convergent.analytics.engine import Engine
    from convergent.analytics.split import split_dataset
    from convergent.analytics.stats import compute_stats

    if out.exists():
        shutil.rmtree(out)
    client = cluster = None
    spill = {}
    if side in ("dask", "naive"):
        from distributed import Client

        from convergent.cluster.pool import make_local_cluster
        from convergent.sim.config import ClusterConfig

        cluster = make_local_cluster(ClusterConfig(n_workers=workers, threads_per_worker=1))
        client = Client(cluster)
        client.wait_for_workers(workers)
        # a long-lived cluster has its modules imported: not part of the measurement
        client.run(_warm)
    _warm()
    cpu0 = _cpu(client)
    t0 = time.perf_counter()
    if side == "naive":
        run_naive(cmd, src, out, client, naive_parts, tol)
    else:
        eng = Engine(client, progress=False)
        if cmd == "stats":
            st = compute_stats(src, eng)
            out.mkdir(parents=True)
            (out / "stats.json").write_text(json.dumps(st))
        elif cmd == "dedup":
            r = dedup_dataset(src, out, tol, eng, shard_bytes=SHARD_BYTES)
            spill = {"intermediate_files": r["spill_files"], "intermediate_bytes": r["spill_bytes"]}
        else:
            split_dataset(src, out, "molecule", "train=0.8,val=0.1,test=0.1", 0, eng, shard_bytes=SHARD_BYTES)
    wall = time.perf_counter() - t0
    cpu1 = _cpu(client)
    cpu = {k: round(cpu1[k] - cpu0.get(k, 0.0), 3) for k in cpu1}
    files, nbytes, per_output = _io(out)
    if client is not None:
        peaks = sorted(v / 1024 for v in client.run(
            lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss).values())
        client.close()
        cluster.close()
    else:
        peaks = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]
    shutil.rmtree(out, ignore_errors=True)
    return {"wall_s": wall, "files": files, "files_per_output": per_output, "bytes": nbytes,
            "peak_rss_mib_per_worker": peaks, "cpu_s": cpu, **spill}


def _warm() -> None:
    import convergent.analytics.dedup  # noqa: F401
    import convergent.analytics.ops  # noqa: F401
    import convergent.analytics.split  # noqa: F401
    import convergent.analytics.stats  # noqa: F401


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu(client) -> dict[str, float]:
    """CPU seconds used so far by this process ("driver") and by each worker."""
    out = {"driver": _self_cpu()}
    if client is not None:
        out.update({f"worker{k}": v for k, v in enumerate(client.run(_self_cpu).values())})
    return out


def _ideal(cmd: str, src: Path, args) -> dict:
    """Two ``single`` processes at once, one per half of the shards; wall = the slower."""
    procs = [_spawn("single", cmd, h, DATA / f"analytics-out-ideal{j}-{cmd}", args)
             for j, h in enumerate(halves(src))]
    res = [_result(p.communicate(), p.returncode) for p in procs]
    bad = [r for r in res if "error" in r]
    if bad:
        return bad[0]
    return {"wall_s": max(r["wall_s"] for r in res), "halves_wall_s": [r["wall_s"] for r in res],
            "cpu_s": {f"half{j}": r["cpu_s"]["driver"] for j, r in enumerate(res)},
            "files": sum(r["files"] for r in res), "bytes": sum(r["bytes"] for r in res)}


def _spawn(side: str, cmd: str, src: Path, out: Path, args) -> subprocess.Popen:
    return subprocess.Popen([*paths.module_argv(__spec__.name), "--one", side, cmd, "--src", str(src),
                             "--child-out", str(out), "--workers", str(args.workers),
                             "--tolerance", str(args.tolerance),
                             "--naive-partitions", str(args.naive_partitions)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=paths.child_env())


def _result(outs: tuple[str, str], rc: int) -> dict:
    stdout, stderr = outs
    if rc != 0:
        return {"error": (stderr or stdout).strip().splitlines()[-1:]}
    return json.loads(stdout.strip().splitlines()[-1])


def _child(side: str, cmd: str, src: Path, args) -> dict:
    if side == "ideal":
        return _ideal(cmd, src, args)
    p = _spawn(side, cmd, src, DATA / f"analytics-out-{side}-{cmd}", args)
    return _result(p.communicate(), p.returncode)


def _autogroup() -> bool | None:
    """Whether the kernel groups CPU shares per session (then load elsewhere caps a
    multi-process run at one session's share)."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return None


def _growth(by_records: dict[str, float | None]) -> float | None:
    small, big = list(by_records.values())
    return big / small if small and big else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--shard-mib", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tolerance", type=float, default=0.01)
    ap.add_argument("--naive-partitions", type=int, default=100)
    ap.add_argument("--naive-rounds", type=int, default=1,
                    help="rounds of the (slow) naive dask.bag side, after the main rounds")
    ap.add_argument("--commands", default=",".join(COMMANDS))
    ap.add_argument("--one", nargs=2, metavar=("SIDE", "CMD"), help=argparse.SUPPRESS)
    ap.add_argument("--src", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    add_args(ap, str(RESULTS), rounds=5)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], args.one[1], args.src, args.child_out, args.workers,
                                 args.tolerance, args.naive_partitions)))
        return
    check_clean(args)
    if os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: "
              "wall-clock speed-ups need idle cores", file=sys.stderr, flush=True)
    src = DATA / f"analytics-v2-{args.records}"  # v2: one formula per molecule
    if not (src / "manifest.json").is_file():
        t = time.perf_counter()
        generate(src, args.records, args.shard_mib)
        print(f"generated {src} in {time.perf_counter() - t:.0f} s", flush=True)
    quarter = DATA / f"analytics-v2-{args.records}-quarter"
    subset(src, quarter, 0.25)
    from convergent.data.manifest import read_manifest

    m = read_manifest(src)
    commands = [c for c in args.commands.split(",") if c]
    common = {"records": m.records, "workers": args.workers, "threads_per_worker": 1,
              "tolerance": args.tolerance}
    side_settings = {
        "dask": {"engine": "convergent.analytics on a LocalCluster", **common},
        "single": {"engine": "convergent.analytics, Engine(client=None), one process",
                   **common, "workers": 1},
        "naive": {"engine": "dask.bag on a LocalCluster", **common,
                  "partitions": args.naive_partitions},
        "ideal": {"engine": "two single processes at once, one per half of the shards "
                            "(the machine's 2-core ceiling)", **common},
    }

    def side(c: str, s: str) -> Side:
        return Side(f"{c}_{s}", lambda r: _child(s, c, src, args), {"command": c, **side_settings[s]})

    res = interleave("analytics", [side(c, s) for c in commands for s in PAIRED], rounds=args.rounds,
                     differences=[
        "single is one process (1 core of 2); dask and naive use a LocalCluster of "
        f"{args.workers} single-threaded workers (cluster start-up not timed)",
        "ideal is two single processes started at once on the two halves of the shards; its "
        "wall time is the slower one's (dedup's halves skip pairs across halves: less work)",
        f"naive (dask.bag) writes one output shard per partition ({args.naive_partitions} "
        "partitions), ours per-worker sinks; same records, tolerance and split fractions",
        f"naive runs {args.naive_rounds} interleaved round(s) of its own after the "
        f"{args.rounds} dask/single rounds; speedup_vs_naive_dask = its median / dask's median"])
    if args.naive_rounds > 0:
        naive = interleave("analytics-naive", [side(c, "naive") for c in commands], rounds=args.naive_rounds)
        res.settings.update(naive.settings)
        res.per_round.update(naive.per_round)
        res.provenance["naive_finished_utc"] = naive.provenance["finished_utc"]
        res.provenance["load_avg_after"] = naive.provenance["load_avg_after"]
        res.summarise()
    else:
        res.per_round.update({f"{c}_naive": [] for c in commands})
    # peak RSS per worker at a quarter of the dataset (same code, same shards): does it grow?
    quarter_m = read_manifest(quarter)
    quarter_peaks = {c: _child("dask", c, quarter, args).get("peak_rss_mib_per_worker")
                     for c in commands}

    summary = {}
    for c in commands:
        runs = {s: res.per_round[f"{c}_{s}"] for s in SIDES}
        d = {s: res.summary.get(f"{c}_{s}", {}).get("wall_s", {}) for s in SIDES}

        def last(s: str, key: str, runs=runs) -> object:
            return runs[s][-1].get(key) if runs[s] else None

        cpu = {s: [x.get("cpu_s") for x in runs[s] if x.get("cpu_s")] for s in SIDES}

        def busiest(xs: list[dict]) -> float:  # median over rounds of the busiest process
            return float(np.median([max(v for k, v in x.items() if k != "driver" or len(x) == 1) for x in xs]))

        ok = {s: [x for x in runs[s] if "error" not in x] for s in SIDES}
        summary[c] = {
            "wall_s": d,
            "speedup_vs_single": res.ratio(f"{c}_single", f"{c}_dask", "wall_s")
            if ok["single"] and ok["dask"] else None,
            "speedup_vs_naive_dask": res.ratio(f"{c}_naive", f"{c}_dask", "wall_s")
            if ok["naive"] and ok["dask"] else None,
            "errors": {s: [x["error"] for x in runs[s] if "error" in x] for s in SIDES},
            "cpu_s": cpu,
            "cpu_bound_speedup_vs_single": (busiest(cpu["single"]) / busiest(cpu["dask"])
                                            if cpu["single"] and cpu["dask"] else None),
            "files_written": {s: last(s, "files") for s in SIDES},
            "files_per_output_dataset": {s: last(s, "files_per_output") for s in SIDES},
            "bytes_written": {s: last(s, "bytes") for s in SIDES},
            "peak_rss_mib_per_worker": {s: max(((x.get("peak_rss_mib_per_worker") or [0])[-1]
                                                for x in runs[s]), default=None) for s in SIDES},
            "peak_rss_mib_per_worker_quarter_dataset": (quarter_peaks[c] or [None])[-1],
            "intermediate_files": last("dask", "intermediate_files") or 0,
            "intermediate_bytes": last("dask", "intermediate_bytes") or 0,
            # what two busy cores give this work on this machine, and ours against it
            "ideal_speedup_vs_single": res.ratio(f"{c}_single", f"{c}_ideal", "wall_s")
            if ok["single"] and ok["ideal"] else None,
            "share_of_ideal": res.ratio(f"{c}_ideal", f"{c}_dask", "wall_s")
            if ok["ideal"] and ok["dask"] else None,
        }
        full = summary[c]["peak_rss_mib_per_worker"]["dask"]
        summary[c]["peak_rss_mib_per_worker_by_records"] = {
            str(quarter_m.records): (quarter_peaks[c] or [None])[-1], str(m.records): full}
    import dask
    import distributed

    import convergent

    sp = [summary[c]["speedup_vs_single"] for c in commands]
    sn = [summary[c]["speedup_vs_naive_dask"] for c in commands]
    cb = [summary[c]["cpu_bound_speedup_vs_single"] for c in commands]
    res.headline.update({
        "speedup_vs_single": min(sp) if all(x is not None for x in sp) else None,
        "speedup_vs_naive_dask": min(x for x in sn if x is not None) if any(x is not None for x in sn) else None,
        "speedup_vs_naive_dask_commands": [c for c, x in zip(commands, sn, strict=True) if x is not None],
        "cpu_bound_speedup_vs_single": min(x for x in cb if x is not None) if any(x is not None for x in cb) else None,
        # the ceiling of 2-way parallelism here (two single processes on halves, at once)
        "ideal_speedup_vs_single": {c: summary[c]["ideal_speedup_vs_single"] for c in commands},
        "share_of_ideal": {c: summary[c]["share_of_ideal"] for c in commands},
        "files_per_stage_max": max(summary[c]["files_per_output_dataset"]["dask"] or 0 for c in commands),
        "workers": args.workers,
        # peak RSS of the busiest worker, dask side, at a quarter of the records and at all of
        # them, per command; growth = ratio (1.0: flat)
        "peak_rss_mib_per_worker": {c: summary[c]["peak_rss_mib_per_worker_by_records"] for c in commands},
        "peak_rss_growth_max": max((_growth(summary[c]["peak_rss_mib_per_worker_by_records"]) or 0)
                                   for c in commands),
        "targets": {"speedup_vs_single": 1.8, "speedup_vs_naive_dask": 1.5, "files_per_stage_max": 2 * args.workers},
        "dataset": {"records": m.records, "shards": len(m.shards), "bytes": m.bytes,
                    "shard_mib": args.shard_mib},
        "commands": summary,
    })
    res.extra = {
        "sched_autogroup_enabled": _autogroup(),
        "versions": {"python": platform.python_version(), "numpy": np.__version__, "dask": dask.__version__,
                     "distributed": distributed.__version__, "convergent": convergent.__version__},
        "output_shard_bytes": SHARD_BYTES,
        "note": "speedups are ratios of median wall times over rounds (the smallest over the "
                "commands is the headline); cpu_bound_speedup_vs_single: CPU seconds of the single process / CPU seconds of the "
                "busiest dask worker (what the wall-clock speed-up would be on idle cores, from CPU "
                "time, which other load does not inflate); files_per_stage_max: most files in one output dataset of a stage, dask side (shards + "
                "manifest + dropped.jsonl); split writes 3 such datasets (files_written counts all); "
                "each measurement in a fresh process and cluster; cluster start-up not timed; "
                "with sched_autogroup_enabled the kernel shares the CPU per session, so on a "
                "loaded machine the whole dask side (driver, scheduler, workers) gets one "
                "session's share, like the single process: wall-clock speed-ups need idle cores",
    }
    write_result(res, args)
    print(json.dumps({k: res.headline[k] for k in ("speedup_vs_single", "speedup_vs_naive_dask",
                                                   "files_per_stage_max", "workers")}))


if __name__ == "__main__":
    main()
