"""Read throughput of many small records: loose files vs convergent shards vs peers.

One run on the same generated data (``--records`` records, log-normal sizes with median
4 KiB, random bytes, made offline with a fixed seed), read once in shuffled order through
a torch DataLoader with the same settings (batch size, workers, list collate) by:

* ``loose``       one file per record (map-style dataset; the sampler gives the *same*
  order as ours: the block shuffle of ``convergent``'s reader for the seed, so both read
  the identical sequence of records; ``--loose-order full`` gives the
  ``DataLoader(shuffle=True)`` idiom instead, a full random permutation, and says so)
* ``convergent``  ``convergent data pack`` shards + the reference streaming reader over
  them (:mod:`bench.dataio.stream`'s ``StreamingDataset``, block shuffle). It is the
  benchmark's reader, not the trainer's: ``convergent train`` reads through
  ``train/moldata.MoleculeSource`` (``open_dataset`` random access, each record once,
  then held in memory), which the next side measures
* ``convergent_random``  the same shards read the trainer's way, ``open_dataset`` random
  access record by record (a map-style dataset), in the same order as ``loose``
* ``convergent_cached``  ``convergent`` through the node-local cache tier (empty at start,
  budget half the dataset: checked copies, prefetch, eviction by next use)
* ``webdataset``  WebDataset 1.0.2 tar shards (our ``data export --to webdataset``)
* ``mds``         mosaicml-streaming 0.13.0 ``StreamingDataset`` (our ``data export --to mds``)
* ``litdata``     litdata (``optimize`` / ``StreamingDataset``)
* ``ideal``       no storage at all: bytes of the same sizes, in the same shuffled order,
  cut from one buffer in memory and sent through the same DataLoader. Its rate is the
  ceiling of any storage system with these DataLoader settings on this machine, and
  ``ideal_vs_loose`` the largest speed-up over loose files that any of them could show.

The page cache is cold and warm side by side (cold is the headline: the small-file
problem is the metadata and I/O cost of a parallel or cold file system, which a warm
page cache hides). Before each cold read every file of that system is evicted
(sync + ``POSIX_FADV_DONTNEED``, plus the dentry/inode caches through
/proc/sys/vm/drop_caches when writable); the warm read follows right after it, on the
pages the cold read brought in. The resident fraction of the system's files (``mincore``
on a sample of 2000 files) is recorded before every read.

Each system is read once per round (cold then warm) for ``--rounds`` rounds, interleaved
over the systems by bench/lib/harness.py so load bursts on a shared machine hit all alike;
per mode every metric is the median over rounds with its spread (never the best run),
beside every run's numbers and the load average. ``--limit`` stops each read
after that many samples of the shuffled epoch (a full cold pass over 1M loose files takes
~10 min alone). Measured per system in a fresh subprocess: samples/s, MB/s, time to
first batch (from dataset construction, incl. any directory scan), peak RSS (main
process and the sum over the process tree incl. DataLoader workers, sampled every 50 ms;
RSS and private memory), and, in one more run under ``strace -f`` (``--strace-limit``
samples, without the memory sampler), the number of open and stat system calls: in
total (incl. Python imports) and on the data files.

Writes bench/results/data_read.json with versions and the machine. Full scale (the
default; data generated once into bench/data/data_read/ and reused, ~5.6 GB per format,
~35 GB in all; generation and builds ~20 min the first time):
``python -m bench.dataio.read --records 1000000 --limit 50000 --rounds 3 --strace-limit 10000``
(~30 min of reads on the shared 2-core machine at load 13-23; a full 1M pass per read
does not fit: mds alone reads ~1-3k samples/s). The peers
mosaicml-streaming and litdata live in another interpreter (``--peer-python``; default:
bench/data/peers-venv if present, made by ``--setup-peers``: mosaicml-streaming 0.13.0
pins numpy<2.2, xxhash<4, transformers<5 and a CUDA torchvision, which conflict with the
project's environment). The MDS and WebDataset copies are written by ``convergent data
export`` (MDS without the streaming package) and read by the real peer libraries.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.dataio.read_os import (
    TRACED,
    count_syscalls,
    evict,
    resident_fraction,
    system_files,
)
from bench.dataio.read_systems import (
    MEDIAN_BYTES,
    PEERS,
    SHARD_BYTES,
    SIGMA,
    SYSTEMS,
    build,
    generate,
    read_once,
    write_loose_order,
)
from bench.lib.harness import Side, add_args, check_clean, interleave, write_result
from bench.lib.paths import DATA, RESULTS, child_env, module_argv

# ---------------------------------------------------------------------------- driver


PEER_PACKAGES = (
    "mosaicml-streaming==0.13.0 webdataset==1.0.2 braceexpand==0.1.7 litdata==0.2.76 "
    "lightning-utilities==0.15.3 zstd==1.5.7.2 python-snappy==0.7.3 cramjam==2.14.0 brotli==1.2.1 "
    "catalogue==2.0.10 boto3==1.44.5 botocore==1.44.5 jmespath==1.1.0 s3transfer==0.19.3 "
    "requests==2.34.2 urllib3==2.8.0"
).split()


def setup_peers(venv: Path) -> str:
    """Make a venv for the peers that sees the project venv's packages (torch, numpy, ...).

    mosaicml-streaming 0.13.0 pins numpy<2.2, transformers<5 and xxhash<4, which conflict
    with the project's environment; its code runs with the project's versions, so the
    peers are installed without dependencies into their own venv, which adds the project
    venv's site-packages through a .pth file. Nothing in the project venv changes.
    """
    import site
    import sysconfig

    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    pyver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (venv / "lib" / pyver / "site-packages" / "_project_venv.pth").write_text(
        "\n".join([*site.getsitepackages(), sysconfig.get_paths()["purelib"]]) + "\n")
    subprocess.run([str(venv / "bin" / "pip"), "install", "--no-deps", *PEER_PACKAGES], check=True)
    return str(venv / "bin" / "python")


def install_torchvision_stub() -> None:
    """mosaicml-streaming imports torchvision for its vision datasets (unused here); the
    PyPI torchvision wheel is a CUDA build that does not load with CPU torch. A stub
    lets ``import streaming`` succeed; nothing of it is called."""
    import importlib.machinery
    import types

    try:
        import torchvision  # noqa: F401

        return
    except Exception:  # noqa: BLE001
        pass

    def mod(name: str) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = m
        return m

    mod("torchvision")
    ds = mod("torchvision.datasets")
    mod("torchvision.transforms")
    fn = mod("torchvision.transforms.functional")
    ds.VisionDataset = type("VisionDataset", (), {})
    fn.to_tensor = lambda x: x


def child_main(args: argparse.Namespace) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.system in ("mds", "litdata", "webdataset") or args.build in ("mds", "litdata"):
        install_torchvision_stub()
    import torch

    torch.set_num_threads(1)
    data = Path(args.data_dir)
    if args.build:
        print(json.dumps({"build_seconds": build(args.build, data, args.records, args.workers)}))
        return
    res = read_once(args.system, data, args.batch_size, args.workers, args.seed, args.limit,
                    sample_memory=not args.no_memory, loose_order=args.loose_order)
    print("RESULT " + json.dumps(res))


def run_child(py: str, system: str, args: argparse.Namespace, strace: bool = False) -> dict:
    cmd = [*module_argv(__spec__.name, py), "--child", "--system", system, "--data-dir", str(args.data_dir),
           "--records", str(args.records), "--batch-size", str(args.batch_size),
           "--workers", str(args.workers), "--seed", str(args.seed),
           "--loose-order", args.loose_order]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    env = child_env()
    if strace:
        with tempfile.TemporaryDirectory() as td:
            trace = Path(td) / "trace"
            cmd = ["strace", "-f", "-qq", "-o", str(trace), "-e", "trace=" + ",".join(TRACED)] + cmd + ["--no-memory"]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
            if out.returncode != 0:
                return {"error": out.stderr[-2000:]}
            return count_syscalls(trace, Path(args.data_dir))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode != 0 or not line:
        return {"error": (out.stderr or out.stdout)[-3000:]}
    return json.loads(line[-1][7:])




def versions(py: str) -> dict:
    code = (
        "import json,importlib.metadata as m\n"
        "out={}\n"
        "for p in ['torch','numpy','webdataset','mosaicml-streaming','litdata','zstandard','xxhash']:\n"
        "    try: out[p]=m.version(p)\n"
        "    except Exception: out[p]=None\n"
        "print(json.dumps(out))"
    )
    out = subprocess.run([py, "-c", code], capture_output=True, text=True)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def machine(load_at_start: tuple[float, float, float]) -> dict:
    import psutil

    from convergent import __version__
    from convergent.cluster.resources import usable_cpus

    cpu = ""
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
            "usable_cpus": usable_cpus(), "memory_GiB": round(psutil.virtual_memory().total / 2**30, 1),
            "load_avg_at_start": load_at_start, "load_avg_at_end": os.getloadavg(), "convergent": __version__}


def summarize(res, modes: tuple[str, ...], systems: list[str]) -> dict[str, dict]:
    """Per mode and system: the median over rounds of every metric, the spread of the rates,
    every run's throughput and the runs themselves."""
    results: dict[str, dict] = {m: {} for m in modes}
    for s in systems:
        rows = res.per_round[s]
        for m in modes:
            runs = [r[m] for r in rows if m in r]
            ok = [r for r in runs if "error" not in r]
            if not ok:
                results[m][s] = runs[-1] if runs else {"error": "no run"}
                continue
            out = {k: float(np.median([r[k] for r in ok])) for k, v in ok[0].items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
            for k in ("samples", "bytes"):
                out[k] = int(out[k])
            out["samples_per_s_spread"] = res.summary[s][f"{m}_samples_per_s"]
            out["MB_per_s_spread"] = res.summary[s][f"{m}_MB_per_s"]
            out["runs_samples_per_s"] = [r["samples_per_s"] for r in ok]
            out["peak_rss_tree_MiB_max"] = max(r["peak_rss_tree_MiB"] for r in ok)
            out["order_digests"] = sorted({r["order_digest"] for r in ok})
            out["runs"] = runs
            results[m][s] = out
    return results


def compare(results: dict[str, dict], runs: dict[str, list[dict]]) -> dict:
    """Speed-ups of convergent over loose files and over the best peer (ratios of medians,
    and the median of the per-round ratios: systems of one round ran back to back)."""
    rate = {s: r["samples_per_s"] for s, r in results.items() if "samples_per_s" in r}
    out: dict = {}

    def paired(a: str, b: str) -> float | None:
        ratios = [x["samples_per_s"] / y["samples_per_s"]
                  for x, y in zip(runs[a], runs[b], strict=False)
                  if "error" not in x and "error" not in y]
        return float(np.median(ratios)) if ratios else None

    if "convergent" in rate and "loose" in rate:
        out["convergent_vs_loose"] = rate["convergent"] / rate["loose"]
        out["convergent_vs_loose_paired_median"] = paired("convergent", "loose")
    if "convergent_random" in rate:  # the trainer's access to the same shards
        for other in ("loose", "convergent"):
            if other in rate:
                out[f"convergent_random_vs_{other}"] = rate["convergent_random"] / rate[other]
                out[f"convergent_random_vs_{other}_paired_median"] = paired("convergent_random", other)
    if "ideal" in rate:
        # the DataLoader's own ceiling: no storage system can beat it with these settings
        if "loose" in rate:
            out["ideal_vs_loose"] = rate["ideal"] / rate["loose"]
            out["ideal_vs_loose_paired_median"] = paired("ideal", "loose")
        if "convergent" in rate:
            out["convergent_vs_ideal"] = rate["convergent"] / rate["ideal"]
    peers = {p: rate[p] for p in PEERS if p in rate}
    if "convergent" in rate and peers:
        best = max(peers, key=peers.get)
        out.update(best_peer=best, convergent_vs_best_peer=rate["convergent"] / peers[best],
                   convergent_vs_best_peer_paired_median=paired("convergent", best))
    return out


SHUFFLES = {
    "loose": "same order as convergent (its block shuffle, window 16384, shards shuffled)",
    "loose_full": "DataLoader(shuffle=True): a full random permutation of the files",
    "convergent": "block shuffle: shard order shuffled, samples shuffled in windows of 16384",
    "convergent_random": "same order as convergent (the loose side's sampler)",
    "convergent_cached": "as convergent",
    "webdataset": "shard order shuffled, then a 1000-sample shuffle buffer",
    "mds": "mosaicml-streaming's default shuffle (py1e) with shuffle_seed",
    "litdata": "litdata's shuffle=True (chunk order shuffled, samples within chunks)",
    "ideal": "sizes in a random permutation (no storage: the order does not matter)",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers (same for all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", type=Path, default=DATA / "data_read")
    ap.add_argument("--peer-python", default=None, help="interpreter with the peer packages")
    ap.add_argument("--no-strace", action="store_true", help="skip the syscall-count runs")
    ap.add_argument("--setup-peers", action="store_true",
                    help="create bench/data/peers-venv with the peer packages first")
    ap.add_argument("--limit", type=int, default=None, help="stop each reader after N samples")
    ap.add_argument("--loose-order", choices=("same", "full"), default="same",
                    help="loose files read in ours' block-shuffled order (same, default) or a "
                         "full random permutation (the DataLoader(shuffle=True) idiom)")
    ap.add_argument("--timeout", type=float, default=7200)
    ap.add_argument("--cache", choices=("both", "cold", "warm"), default="both",
                    help="page cache before each read: cold (the system's files evicted), warm "
                         "(right after the cold read), or both side by side (default)")
    ap.add_argument("--strace-limit", type=int, default=20000,
                    help="samples read in the syscall-count run of each system")
    ap.add_argument("--note", default="", help="free text stored in the JSON (e.g. CPU sharing)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--system", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--build", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-memory", action="store_true", help=argparse.SUPPRESS)
    add_args(ap, str(RESULTS / "data_read.json"), rounds=3)
    ap.add_argument("--repeats", dest="rounds", type=int, default=argparse.SUPPRESS,
                    help="the same as --rounds")
    args = ap.parse_args()
    if args.child:
        child_main(args)
        return
    check_clean(args)
    systems = [s for s in args.systems.split(",") if s]
    peer_py = args.peer_python
    if args.setup_peers:
        peer_py = setup_peers(DATA / "peers-venv")
    if peer_py is None:
        cand = DATA / "peers-venv" / "bin" / "python"
        peer_py = str(cand) if cand.exists() else sys.executable
    args.data_dir.mkdir(parents=True, exist_ok=True)
    print(f"generating {args.records} loose files in {args.data_dir} ...", flush=True)
    gen = generate(args.data_dir, args.records, args.seed)
    builds = {}
    for s in ["convergent", *[p for p in PEERS if p in systems]]:
        if s != "litdata":  # ours, and the exports of webdataset and mds, run here
            builds[s] = build(s, args.data_dir, args.records, args.workers)
        else:
            cmd = [*module_argv(__spec__.name, peer_py), "--child", "--build", s, "--data-dir",
                   str(args.data_dir), "--records", str(args.records), "--workers", str(args.workers)]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                 env=child_env())
            if out.returncode != 0:
                print(f"build {s} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                builds[s] = None
                continue
            builds[s] = json.loads(out.stdout.strip().splitlines()[-1])["build_seconds"]
        print(f"built {s}: {builds[s]:.1f} s", flush=True)
    write_loose_order(args.data_dir, args.seed, args.batch_size)
    modes = {"both": ("cold", "warm"), "cold": ("cold",), "warm": ("warm",)}[args.cache]
    files = {s: system_files(s, args.data_dir) for s in systems}

    def side(s: str):
        py = peer_py if s in PEERS else sys.executable

        def run(rnd: int) -> dict:
            # per system the cold read comes first and the warm one right after it (the
            # cold read brought the same samples into the page cache)
            row: dict = {}
            for mode in modes:
                ev = evict(files[s]) if mode == "cold" else {}
                ev["resident_before"] = resident_fraction(files[s], seed=max(rnd, 0))
                r = run_child(py, s, args)
                r.update(ev, load_avg=os.getloadavg())
                row[mode] = r
                for k in ("samples_per_s", "MB_per_s", "time_to_first_batch_s"):
                    if k in r:
                        row[f"{mode}_{k}"] = r[k]
            return row
        return run

    settings = {"batch_size": args.batch_size, "num_workers": args.workers, "seed": args.seed,
                "limit": args.limit, "records": args.records,
                "torch_threads_per_process": 1}
    sides = [Side(s, side(s), dict(settings, shuffle=SHUFFLES[
        "loose_full" if s == "loose" and args.loose_order == "full" else s],
        interpreter="peers" if s in PEERS else "ours")) for s in systems]
    differences = [
        "every system reads through the same torch DataLoader settings (batch size, workers, "
        "list collate, 1 torch thread); only the storage format and its reader differ",
        "convergent is the reference streaming reader over our shard format "
        "(bench/dataio/stream.py), not the trainer's reader (train/moldata.MoleculeSource)",
        "shuffle: loose reads the same records in the same order as convergent "
        "(order_digests equal)" if args.loose_order == "same" else
        "shuffle: loose uses a full random permutation (DataLoader(shuffle=True)), convergent "
        "a block shuffle (window 16384 samples): a harder access pattern for loose files",
    ]
    if "convergent_random" in systems:
        differences.append("convergent_random reads our shards the trainer's way (open_dataset "
                           "random access, record by record) in convergent's order; the trainer "
                           "itself reads each record once, holds it in memory and uses no DataLoader")
    if any(p in systems for p in PEERS):
        differences.append("the peers' own shuffles (settings.*.shuffle) are their defaults, "
                           "each a windowed/chunked shuffle unlike ours in detail")
    res = interleave("data_read", sides, rounds=args.rounds, differences=differences)
    results = summarize(res, modes, systems)
    if not args.no_strace:
        # syscall counts (warm; one run per system under strace -f, --strace-limit samples)
        slim = argparse.Namespace(**dict(vars(args), limit=args.strace_limit))
        for s in systems:
            py = peer_py if s in PEERS else sys.executable
            sc = run_child(py, s, slim, strace=True)
            for m in modes:
                if s in results[m]:
                    results[m][s]["syscalls"] = sc
    summary = {m: compare(results[m], {s: [r[m] for r in res.per_round[s]] for s in systems})
               for m in modes}
    for other in ("loose", "convergent_random"):
        if other in systems and "convergent" in systems:
            do = set(results[modes[0]][other].get("order_digests", []))
            dc = set(results[modes[0]]["convergent"].get("order_digests", []))
            for m in modes:
                summary[m][f"{other}_same_order_as_convergent"] = bool(do) and do == dc
    res.headline.update({
        "headline": "cold" if "cold" in modes else "warm", "summary": summary,
        "results": results})
    res.extra = {
        "settings": {"records": args.records, "size_distribution": f"log-normal, median {MEDIAN_BYTES} B, sigma {SIGMA}, clipped 64 B..1 MiB",
                     "batch_size": args.batch_size, "num_workers": args.workers, "shuffle": True,
                     "loose_order": args.loose_order,
                     "shard_bytes": SHARD_BYTES, "limit": args.limit, "seed": args.seed,
                     "rounds": args.rounds, "reported": "median over rounds, spread beside",
                     "strace_limit": args.strace_limit,
                     "page_cache": {"cold": "the system's files evicted (POSIX_FADV_DONTNEED; dentry/inode "
                                            "caches dropped when /proc/sys/vm/drop_caches is writable) before the read",
                                    "warm": "read right after the cold read of the same samples"}},
        "generation": gen, "build_seconds": builds,
        "versions": {"ours": versions(sys.executable), "peers": versions(peer_py)},
        "machine": machine(tuple(res.provenance["load_avg_before"])), "note": args.note}
    data = res.to_dict()
    # the smoke test and older readers look for these at the top level
    data["versions"], data["machine"] = res.extra["versions"], res.extra["machine"]
    write_result(data, args)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
