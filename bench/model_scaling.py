"""Forward+backward (energy + forces) time and peak memory vs atom count N.

Periodic fcc Cu supercells built with ASE, N = 128 ... 131,072 (exact doublings), for
``attention = neighbor | topk | dense``. Each (mode, N) point runs in a fresh subprocess
with an address-space limit (``--mem-gb``) and a time limit (``--time-limit``), so
"out of memory" is a clean failure of that point instead of the machine's OOM killer.
A mode stops at its first failed point. "forward+backward" = neighbour list + energy +
forces (-dE/dpositions, one backward pass), what an MD step or a screening call costs.

Writes bench/results/model_scaling.json. Usage:
    .venv/bin/python bench/model_scaling.py [--max-n 131072] [--modes neighbor,topk,dense]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# glibc returns every allocation above 32 MB to the OS (mmap) and page-faults it back
# on the next use, which makes large-N runs superlinear for reasons unrelated to the
# model; the usual fix on HPC nodes is jemalloc/tcmalloc or these two settings.
ALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(64 * 2**30)}


def cu_cell_repeats(n_atoms: int) -> tuple[int, int, int]:
    """Repeats of the 4-atom cubic Cu cell giving exactly n_atoms (a power-of-two multiple of 4)."""
    k = n_atoms // 4
    reps = [1, 1, 1]
    i = 0
    while k > 1:
        reps[i % 3] *= 2
        k //= 2
        i += 1
    return tuple(sorted(reps, reverse=True))  # type: ignore[return-value]


def child(mode: str, n: int, hidden: int, layers: int, cutoff: float, topk: int, repeats: int) -> dict:
    import resource

    import numpy as np
    import torch
    from ase.build import bulk

    from convergent.models.batching import atoms_to_record, collate_records
    from convergent.models.config import ModelConfig
    from convergent.models.molecular import build_model, energy_and_forces

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(cu_cell_repeats(n))
    atoms.rattle(0.05, seed=0)
    assert len(atoms) == n
    torch.manual_seed(0)
    model = build_model(ModelConfig(hidden=hidden, layers=layers, heads=4, cutoff=cutoff,
                                    attention=mode, topk=topk))
    batch = collate_records([atoms_to_record(atoms)])
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, cpu_times, nl_times = [], [], []
    for it in range(repeats + 1):
        t, c = time.perf_counter(), time.thread_time()
        e, f = energy_and_forces(model, batch, training=False)
        dt, dc = time.perf_counter() - t, time.thread_time() - c
        if it > 0 or repeats == 0:
            times.append(dt)
            cpu_times.append(dc)
        if mode == "neighbor":
            from convergent.models.atoms import neighbor_list

            t = time.perf_counter()
            nl = neighbor_list(batch.positions, cutoff, cell=batch.cell, pbc=batch.pbc)
            nl_times.append(time.perf_counter() - t)
        if dt > 60 and times:  # slow point: one timed run after the warm-up is enough
            break
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {
        "mode": mode, "n_atoms": n, "seconds": float(np.min(times)),
        "seconds_median": float(np.median(times)), "seconds_all": times,
        "cpu_seconds": float(np.min(cpu_times)), "cpu_seconds_all": cpu_times,
        "peak_rss_mb": peak / 1024, "peak_rss_above_setup_mb": (peak - base_rss) / 1024,
        "energy_finite": bool(torch.isfinite(e).all()), "force_norm_mean": float(f.norm(dim=1).mean()),
        "load_avg": list(os.getloadavg()),
    }
    if mode == "neighbor":
        out["neighbor_list_seconds"] = float(np.median(nl_times))
        out["edges"] = nl.num_edges
        out["neighbors_per_atom"] = nl.num_edges / n
    else:
        out["edges"] = n * (n - 1)
    return out


def run_point(args: argparse.Namespace, mode: str, n: int) -> dict:
    import resource

    limit = int(args.mem_gb * 2**30)

    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    cmd = [sys.executable, __file__, "--child", mode, str(n), "--hidden", str(args.hidden),
           "--layers", str(args.layers), "--cutoff", str(args.cutoff), "--topk", str(args.topk)]
    t = time.perf_counter()
    try:
        env = {**os.environ, **(ALLOC_ENV if args.alloc_env else {})}
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.time_limit,
                           preexec_fn=preexec, env=env)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "n_atoms": n, "failed": f"time limit {args.time_limit}s"}
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["?"])[-1]
        kind = "out of memory" if ("memory" in p.stderr.lower() or "alloc" in p.stderr.lower()
                                   or p.returncode in (-9, 137)) else "error"
        return {"mode": mode, "n_atoms": n, "failed": f"{kind}: {tail[:200]}",
                "wall": time.perf_counter() - t}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=2)
    ap.add_argument("--modes", default="neighbor,topk,dense")
    ap.add_argument("--min-n", type=int, default=128)
    ap.add_argument("--max-n", type=int, default=131072)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--cutoff", type=float, default=4.0)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--mem-gb", type=float, default=10.0)
    ap.add_argument("--time-limit", type=float, default=600.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-alloc-env", dest="alloc_env", action="store_false")
    ap.add_argument("--keep-other-modes", action="store_true",
                    help="keep results of modes not run now from the previous JSON")
    args = ap.parse_args()
    if args.child:
        mode, n = args.child[0], int(args.child[1])
        reps = args.repeats if n <= 16384 else min(args.repeats, 2)  # CPU budget at large N
        print(json.dumps(child(mode, n, args.hidden, args.layers, args.cutoff, args.topk, reps)))
        return

    from molbench import RESULTS, write_result

    results: dict[str, list[dict]] = {}
    prev = RESULTS / "model_scaling.json"
    if args.keep_other_modes and prev.exists():
        results = {m: rs for m, rs in json.loads(prev.read_text())["results"].items()
                   if m not in args.modes.split(",")}
    for mode in args.modes.split(","):
        results[mode] = []
        n = args.min_n
        while n <= args.max_n:
            r = run_point(args, mode, n)
            print(json.dumps(r), flush=True)
            results[mode].append(r)
            if "failed" in r:
                break
            n *= 2
    ok = [r for r in results.get("neighbor", []) if "failed" not in r]

    def per_doubling(key: str) -> list[tuple[int, float]]:
        return [(b["n_atoms"], b[key] / a[key]) for a, b in zip(ok, ok[1:], strict=False)
                if key in a and key in b]

    def slope(key: str) -> float | None:
        pts = [(math.log(r["n_atoms"]), math.log(r[key])) for r in ok if r["n_atoms"] >= 1024 and key in r]
        if len(pts) < 2:
            return None
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)

    largest = {m: max((r["n_atoms"] for r in rs if "failed" not in r), default=0) for m, rs in results.items()}
    summary: dict = {"largest_n_completed": largest,
                     "criterion_neighbor_runs_100k": largest.get("neighbor", 0) >= 100_000}
    for key in ("cpu_seconds", "seconds"):
        pd = per_doubling(key)
        big = [r for n, r in pd if n >= 2048]
        summary[f"neighbor_{key}_ratio_per_doubling"] = {str(n): r for n, r in pd}
        summary[f"neighbor_{key}_max_ratio_per_doubling_n_ge_1024"] = max(big) if big else None
        summary[f"neighbor_{key}_loglog_slope_n_ge_1024"] = slope(key)
        summary[f"criterion_ratio_le_2.2_{key}"] = bool(big) and max(big) <= 2.2
    path = write_result("model_scaling", {
        "system": "periodic fcc Cu (a=3.61 Å) supercell, rattled 0.05 Å",
        "model": {"hidden": args.hidden, "layers": args.layers, "heads": 4, "cutoff_A": args.cutoff,
                  "topk": args.topk},
        "what": "neighbour list + energy + forces (one backward), fp32, 1 torch thread; "
                "seconds = min wall over repeats (least-disturbed run on a shared CPU), median also "
                "given; cpu_seconds = min thread CPU time (robust to other jobs on the CPU)",
        "allocator_env": ALLOC_ENV if args.alloc_env else None,
        "limits": {"address_space_gb": args.mem_gb, "seconds": args.time_limit},
        "results": results, "summary": summary,
    })
    print(json.dumps(summary, indent=2))
    print("wrote", path)


if __name__ == "__main__":
    main()
