"""Simulation throughput: a plain serial GFN2-xTB loop vs the Dask campaign on 2 workers.

    python bench/sim_throughput.py                 # ~1-2 minutes on 2 cores
    python bench/sim_throughput.py --frames 2000 --chunk-sizes 50,10,1

Same frames on both sides (rattled C/H/N/O molecules of ASE's G2 collection, seed 0):

* ``serial``: one process, one thread, ``for frame: TBLite(...).get_potential_energy();
  get_forces()`` — no framework at all. Run before *and* after the campaign (mean used),
  because the machine may be shared.
* ``campaign``: :func:`convergent.sim.campaign.run_campaign` on an already started 2-worker
  LocalCluster (cluster start-up reported separately), writing the real dataset.

Reports frames/s, parallel efficiency ``(serial_wall / campaign_wall) / workers`` (target
>= 0.85), the per-task framework overhead ``(workers * wall - sum(calc s)) / tasks``, the
bare Dask round trip of a no-op task, and CPU seconds of every process (the CPU-based
efficiency shows how much of a shortfall comes from other load on a shared machine).
Writes bench/results/sim_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("dask", "distributed", "tblite", "ase", "numpy", "convergent"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def _machine() -> dict:
    from convergent.resources import usable_cpus

    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "usable_cpus": usable_cpus(),
        "os_cpu_count": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
    }


def _frames(sim):
    from convergent.sim.campaign import plan_tasks
    from convergent.sim.sources import load_molecules

    mols, _ = load_molecules(sim.source, sim.elements, sim.min_atoms, sim.max_atoms,
                             sim.max_molecules, sim.seed)
    return [it for t in plan_tasks(sim, mols) for it in t.items]


def serial_loop(items) -> dict:
    """The baseline: a plain loop of tblite single points in this process."""
    from ase import Atoms
    from tblite.ase import TBLite

    t0, c0 = time.perf_counter(), time.process_time()
    for it in items:
        atoms = Atoms(numbers=it.numbers, positions=it.structure())
        atoms.calc = TBLite(method="GFN2-xTB", charge=it.charge, multiplicity=it.multiplicity,
                            verbosity=0)
        atoms.get_potential_energy()
        atoms.get_forces()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"frames": len(items), "wall_s": wall, "cpu_s": cpu, "frames_per_s": len(items) / wall}


def _serial_part(items) -> float:
    """Worker of the plain multi-process reference: wall seconds of a serial loop."""
    return serial_loop(items)["wall_s"]


def plain_processes(pool, items, n: int) -> dict:
    """The hardware reference: ``n`` plain processes (no Dask), each a serial loop on 1/n."""
    parts = [items[i::n] for i in range(n)]
    t0 = time.perf_counter()
    pool.map(_serial_part, parts)
    wall = time.perf_counter() - t0
    return {"processes": n, "wall_s": wall, "frames_per_s": len(items) / wall}


def _noop() -> int:
    return 0


def dask_roundtrip(client, n: int = 200) -> float:
    """Mean seconds of a no-op Dask task submitted one after another (latency)."""
    client.submit(_noop, pure=False).result()
    t0 = time.perf_counter()
    for _ in range(n):
        client.submit(_noop, pure=False).result()
    return (time.perf_counter() - t0) / n


def _worker_cpu(client) -> float:
    import psutil

    pids = client.run(os.getpid)
    total = 0.0
    for pid in pids.values():
        ct = psutil.Process(pid).cpu_times()
        total += ct.user + ct.system
    return total


def campaign(client, sim, out: Path) -> dict:
    from convergent.sim.campaign import run_campaign
    from convergent.sim.config import ClusterConfig

    if out.exists():
        shutil.rmtree(out)
    w0, c0 = _worker_cpu(client), time.process_time()
    t0 = time.perf_counter()
    s = run_campaign(sim, ClusterConfig(), out, progress=False, client=client)
    wall = time.perf_counter() - t0
    w1, c1 = _worker_cpu(client), time.process_time()
    n_workers = s.n_workers
    return {
        "chunk_size": sim.chunk_size,
        "frames": s.done,
        "quarantined": s.quarantined,
        "tasks": s.tasks_run,
        "workers": n_workers,
        "wall_s": wall,
        "compute_wall_s": s.compute_wall_s,
        "frames_per_s": s.done / wall,
        "sum_calc_s": s.calc_s,
        "sum_task_s_on_workers": s.task_wall_s,
        "mean_calc_s": s.mean_calc_s,
        "overhead_per_task_s": (n_workers * wall - s.calc_s) / max(1, s.tasks_run),
        # fraction of the workers' wall time spent inside calculations (1.0 = no overhead);
        # robust to other load because calc seconds are wall seconds on the same workers
        "worker_utilisation": s.calc_s / (n_workers * wall),
        "worker_side_overhead_per_task_s": (s.task_wall_s - s.calc_s) / max(1, s.tasks_run),
        "worker_cpu_s": w1 - w0,
        "driver_cpu_s": c1 - c0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=1200)
    ap.add_argument("--chunk-sizes", default="50,10,1", help="campaign chunk sizes to run")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved serial/campaign runs")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sim_throughput.json"))
    args = ap.parse_args(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"  # before tblite loads: one thread, like a Dask worker

    from convergent.cluster import dask_client
    from convergent.sim.config import ClusterConfig, SimulateConfig

    machine = _machine()
    chunks = [int(c) for c in args.chunk_sizes.split(",") if c.strip()]
    base = SimulateConfig(frames=args.frames, flush_every_s=10.0)
    items = _frames(base)
    serial_loop(items[:20])  # warm-up: imports, parameter files

    tmp = Path(tempfile.mkdtemp(prefix="sim_bench_"))
    serial: list[dict] = []
    plain: list[dict] = []
    runs: dict[int, list[dict]] = {cs: [] for cs in chunks}
    ctx = multiprocessing.get_context("spawn")
    t0 = time.perf_counter()
    with dask_client(ClusterConfig(n_workers=args.workers)) as client, \
            ctx.Pool(args.workers) as pool:
        client.wait_for_workers(args.workers)
        startup = time.perf_counter() - t0
        warm = base.model_copy(update={"frames": 4 * args.workers, "chunk_size": 1})
        campaign(client, warm, tmp / "warm")  # import tblite on every worker
        plain_processes(pool, items[: 4 * args.workers], args.workers)
        roundtrip = dask_roundtrip(client)
        # interleave the three so all see the same (shared) machine
        for rep in range(args.repeats):
            serial.append(serial_loop(items))
            print(f"[{rep}] serial: {serial[-1]['frames_per_s']:.1f} frames/s", flush=True)
            plain.append(plain_processes(pool, items, args.workers))
            print(f"[{rep}] {args.workers} plain processes: {plain[-1]['frames_per_s']:.1f} "
                  "frames/s", flush=True)
            for cs in chunks:
                r = campaign(client, base.model_copy(update={"chunk_size": cs}), tmp / f"c{cs}")
                runs[cs].append(r)
                print(f"[{rep}] campaign chunk {cs}: {r['frames_per_s']:.1f} frames/s, "
                      f"overhead {r['overhead_per_task_s'] * 1e3:.1f} ms/task", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)

    # best-of-N on each side (least disturbed by other load), median for reference
    serial_wall = min(r["wall_s"] for r in serial)
    serial_cpu = min(r["cpu_s"] for r in serial)
    plain_wall = min(r["wall_s"] for r in plain)
    summary = []
    for rs in runs.values():
        best = dict(min(rs, key=lambda r: r["wall_s"]))
        walls = sorted(r["wall_s"] for r in rs)
        best["median_wall_s"] = walls[len(walls) // 2]
        best["parallel_efficiency"] = serial_wall / best["wall_s"] / best["workers"]
        best["parallel_efficiency_median"] = (
            statistics.median(r["wall_s"] for r in serial) / best["median_wall_s"] / best["workers"])
        best["speedup"] = serial_wall / best["wall_s"]
        best["framework_efficiency_vs_plain_processes"] = plain_wall / best["wall_s"]
        best["cpu_work_efficiency"] = serial_cpu / max(min(r["worker_cpu_s"] for r in rs), 1e-9)
        summary.append(best)
    best = max(summary, key=lambda r: r["parallel_efficiency"])
    machine["loadavg_end"] = os.getloadavg()
    result = {
        "benchmark": "sim_throughput",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "workload": {"source": base.source, "elements": base.elements,
                     "max_atoms": base.max_atoms, "sampler": "rattle",
                     "sigma": base.rattle_sigma, "method": "GFN2-xTB (tblite)",
                     "frames": len(items),
                     "mean_atoms": sum(len(i.numbers) for i in items) / len(items)},
        "repeats": args.repeats,
        "serial": {"runs": serial, "best_wall_s": serial_wall,
                   "frames_per_s": len(items) / serial_wall},
        "plain_processes": {"runs": plain, "best_wall_s": plain_wall,
                            "frames_per_s": len(items) / plain_wall,
                            "hardware_scaling": serial_wall / plain_wall / args.workers},
        "cluster_startup_s": startup,
        "dask_noop_roundtrip_s": roundtrip,
        "campaign": summary,
        "campaign_runs": runs,
        "best": {"chunk_size": best["chunk_size"],
                 "parallel_efficiency": best["parallel_efficiency"],
                 "overhead_per_task_s": best["overhead_per_task_s"],
                 "worker_utilisation": best["worker_utilisation"],
                 "framework_efficiency_vs_plain_processes":
                     best["framework_efficiency_vs_plain_processes"],
                 "hardware_scaling_plain_processes": serial_wall / plain_wall / args.workers,
                 "target": 0.85, "met": best["parallel_efficiency"] >= 0.85},
        "machine": machine,
        "versions": _versions(),
        "note": ("2 cores shared with other sessions while measuring: wall-clock numbers are "
                 "noisy (best of N interleaved runs used). parallel_efficiency = serial wall / "
                 "campaign wall / workers (the target metric). hardware_scaling = the same for "
                 "plain processes without any framework: the ceiling this machine allowed at "
                 "the time. framework_efficiency_vs_plain_processes = plain wall / campaign "
                 "wall isolates the cost of Dask + the campaign. worker_utilisation = sum of "
                 "calculation seconds / (workers x campaign wall). cpu_work_efficiency = serial "
                 "CPU s / worker CPU s; loadavg shows the contention."),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["best"]), f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
