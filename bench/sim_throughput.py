"""Simulation throughput: a plain serial GFN2-xTB loop vs the Dask campaign on 2 workers.

    python bench/sim_throughput.py                 # ~2.5 minutes on a quiet 2-core machine
    python bench/sim_throughput.py --frames 2000 --chunk-sizes 100,10 --repeats 2

Same frames on both sides (rattled C/H/N/O molecules of ASE's G2 collection, seed 0,
``SimulateConfig`` defaults otherwise; 5,000 frames like the issue's example campaign):

* ``serial``: one process, one OpenMP/BLAS thread, ``for frame: make_calculator(spec)``
  (the campaign's calculator with the same settings) ``get_potential_energy();
  get_forces()`` — no framework and no writing at all.
* ``plain_processes``: the same loop split over ``workers`` plain processes (no Dask, no
  writing): the scaling the hardware allows at that moment (the ceiling).
* ``campaign``: :func:`convergent.sim.campaign.run_campaign` on an already started
  LocalCluster (start-up reported separately), writing the real checksummed dataset;
  after each run the dataset is verified (every shard's xxh3, every record) untimed.

The three are interleaved (serial, plain, each chunk size; repeated) so load from other
work on a shared machine hits all alike; ``os.getloadavg()`` is recorded around each run.

Reported per campaign run: frames/s; ``parallel_efficiency`` = campaign frames/s /
(workers x serial frames/s) (target >= 0.85); per-task overhead
``(workers x wall - sum calc s) / tasks``; the worker-side part of it; CPU seconds of the
driver process (main thread: unpickling results, appending to shards, quarantine,
progress; other threads: the Dask client and the LocalCluster scheduler) and of the
workers; ``cpu_efficiency`` = serial CPU s / (driver + workers CPU s), which other load
disturbs much less than wall time; ``fixed_s`` = wall outside the task farm (loading
molecules, planning, fingerprint, opening and closing the dataset).
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
import threading
import time
from importlib import metadata
from pathlib import Path

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("dask", "distributed", "tblite", "ase", "numpy", "zstandard", "convergent"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def _machine() -> dict:
    from convergent.resources import cpu_name, usable_cpus

    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "usable_cpus": usable_cpus(),
        "os_cpu_count": os.cpu_count(),
    }


def _frames(sim):
    from convergent.sim.plan import plan_tasks
    from convergent.sim.sources import load_molecules

    mols, _ = load_molecules(sim.source, sim.elements, sim.min_atoms, sim.max_atoms,
                             sim.max_molecules, sim.seed)
    return [it for t in plan_tasks(sim, mols) for it in t.items]


def serial_loop(items, spec) -> dict:
    """The baseline: a plain loop of single points with the campaign's calculator."""
    from ase import Atoms

    from convergent.sim.calculators import make_calculator

    load0 = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    for it in items:
        atoms = Atoms(numbers=it.numbers, positions=it.structure())
        atoms.calc = make_calculator(spec, it.charge, it.multiplicity)
        atoms.get_potential_energy()
        atoms.get_forces()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"frames": len(items), "wall_s": wall, "cpu_s": cpu,
            "frames_per_s": len(items) / wall, "loadavg": [load0, os.getloadavg()[0]]}


def _serial_part(args) -> float:
    """Worker of the plain multi-process reference: wall seconds of a serial loop."""
    items, spec = args
    return serial_loop(items, spec)["wall_s"]


def plain_processes(pool, items, spec, n: int) -> dict:
    """The hardware reference: ``n`` plain processes (no Dask), each a serial loop on 1/n."""
    parts = [(items[i::n], spec) for i in range(n)]
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    pool.map(_serial_part, parts)
    wall = time.perf_counter() - t0
    return {"processes": n, "wall_s": wall, "frames_per_s": len(items) / wall,
            "loadavg": [load0, os.getloadavg()[0]]}


def _thread_cpu() -> dict[int, float]:
    import psutil

    return {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}


def _worker_cpu(client) -> float:
    import psutil

    total = 0.0
    for pid in client.run(os.getpid).values():
        ct = psutil.Process(pid).cpu_times()
        total += ct.user + ct.system
    return total


def _worker_threads(client) -> dict:
    """Threads and thread settings of each worker process (1 OpenMP/BLAS thread expected)."""
    import psutil

    def probe() -> dict:
        return {"pid": os.getpid(), **{v: os.environ.get(v) for v in THREAD_VARS}}

    out = {}
    for addr, info in client.run(probe).items():
        info["os_threads"] = psutil.Process(info["pid"]).num_threads()
        out[addr] = info
    return out


def campaign(client, sim, out: Path) -> dict:
    """One campaign run into a fresh dataset, with the driver's and workers' CPU seconds."""
    from convergent.data.verify import verify_dataset
    from convergent.sim.campaign import run_campaign
    from convergent.sim.config import ClusterConfig

    if out.exists():
        shutil.rmtree(out)
    main_tid = threading.get_native_id()
    load0 = os.getloadavg()[0]
    w0, th0, c0 = _worker_cpu(client), _thread_cpu(), time.process_time()
    t0 = time.perf_counter()
    s = run_campaign(sim, ClusterConfig(), out, progress=False, client=client)
    wall = time.perf_counter() - t0
    w1, th1, c1 = _worker_cpu(client), _thread_cpu(), time.process_time()
    load1 = os.getloadavg()[0]
    main_cpu = th1.get(main_tid, 0.0) - th0.get(main_tid, 0.0)
    rep = verify_dataset(out, deep=True)
    if rep.problems or rep.records != s.done:
        raise SystemExit(f"campaign dataset {out} failed verification: {rep.problems[:3]}")
    workers, tasks = s.n_workers, max(1, s.tasks_run)
    driver_cpu, worker_cpu = c1 - c0, w1 - w0
    return {
        "chunk_size": sim.chunk_size,
        "frames": s.done,
        "quarantined": s.quarantined,
        "tasks": s.tasks_run,
        "workers": workers,
        "wall_s": wall,
        "compute_wall_s": s.compute_wall_s,
        "fixed_s": wall - s.compute_wall_s,
        "frames_per_s": s.done / wall,
        "sum_calc_s": s.calc_s,
        "sum_task_s_on_workers": s.task_wall_s,
        "mean_calc_s": s.mean_calc_s,
        "overhead_per_task_s": (workers * wall - s.calc_s) / tasks,
        "worker_side_overhead_per_task_s": (s.task_wall_s - s.calc_s) / tasks,
        "worker_utilisation": s.calc_s / (workers * wall),
        "driver_cpu_s": driver_cpu,
        "driver_main_thread_cpu_s": main_cpu,
        "driver_other_threads_cpu_s": driver_cpu - main_cpu,
        "driver_cpu_per_task_s": driver_cpu / tasks,
        "worker_cpu_s": worker_cpu,
        "dataset_shards": rep.shards,
        "dataset_bytes": rep.bytes,
        "loadavg": [load0, load1],
    }


def _summarise(rs: list[dict], serial: list[dict], plain_wall: float) -> dict:
    serial_fps = max(r["frames_per_s"] for r in serial)
    serial_cpu = min(r["cpu_s"] for r in serial)
    best = dict(min(rs, key=lambda r: r["wall_s"]))
    n = best["workers"]
    best["parallel_efficiency"] = best["frames_per_s"] / (n * serial_fps)
    best["parallel_efficiency_median"] = (
        statistics.median(r["frames_per_s"] for r in rs)
        / (n * statistics.median(r["frames_per_s"] for r in serial)))
    best["framework_efficiency_vs_plain_processes"] = plain_wall / best["wall_s"]
    best["cpu_efficiency"] = serial_cpu / min(r["driver_cpu_s"] + r["worker_cpu_s"] for r in rs)
    best["runs"] = len(rs)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=5000)
    ap.add_argument("--chunk-sizes", default="200,100,50,10",
                    help="campaign chunk sizes to run (frames per task)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved serial/campaign runs")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sim_throughput.json"))
    args = ap.parse_args(argv)
    for var in THREAD_VARS:
        os.environ[var] = "1"  # before tblite loads: one thread, like a Dask worker

    from convergent.cluster import dask_client
    from convergent.sim.calculators import CalcSpec
    from convergent.sim.config import ClusterConfig, SimulateConfig

    machine = _machine()
    loadavg_start = os.getloadavg()
    chunks = [int(c) for c in args.chunk_sizes.split(",") if c.strip()]
    base = SimulateConfig(frames=args.frames)
    spec = CalcSpec.from_simulate(base)
    items = _frames(base)
    serial_loop(items[:20], spec)  # warm-up: imports, parameter files

    tmp = Path(tempfile.mkdtemp(prefix="sim_bench_"))
    serial: list[dict] = []
    plain: list[dict] = []
    runs: dict[int, list[dict]] = {cs: [] for cs in chunks}
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(args.workers) as pool:
        plain_processes(pool, items[: 4 * args.workers], spec, args.workers)  # warm-up
        t0 = time.perf_counter()
        with dask_client(ClusterConfig(n_workers=args.workers)) as client:
            client.wait_for_workers(args.workers)
            startup = time.perf_counter() - t0
            warm = base.model_copy(update={"frames": 4 * args.workers, "chunk_size": 1})
            campaign(client, warm, tmp / "warm")  # import tblite on every worker
            threads = {"serial_process": {v: os.environ.get(v) for v in THREAD_VARS},
                       "workers": _worker_threads(client)}
            for rep in range(args.repeats):
                serial.append(serial_loop(items, spec))
                print(f"[{rep}] serial: {serial[-1]['frames_per_s']:.1f} frames/s", flush=True)
                plain.append(plain_processes(pool, items, spec, args.workers))
                print(f"[{rep}] {args.workers} plain processes: "
                      f"{plain[-1]['frames_per_s']:.1f} frames/s", flush=True)
                for cs in chunks:
                    r = campaign(client, base.model_copy(update={"chunk_size": cs}),
                                 tmp / f"c{cs}")
                    runs[cs].append(r)
                    print(f"[{rep}] campaign chunk {cs}: {r['frames_per_s']:.1f} frames/s, "
                          f"overhead {r['overhead_per_task_s'] * 1e3:.1f} ms/task, driver "
                          f"CPU {r['driver_cpu_s']:.2f} s, load {r['loadavg'][1]:.1f}",
                          flush=True)
    shutil.rmtree(tmp, ignore_errors=True)

    serial_wall = min(r["wall_s"] for r in serial)
    plain_wall = min(r["wall_s"] for r in plain)
    summary = [_summarise(rs, serial, plain_wall) for rs in runs.values()]
    best = max(summary, key=lambda r: r["parallel_efficiency"])
    hardware = serial_wall / plain_wall / args.workers
    result = {
        "benchmark": "sim_throughput",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python bench/sim_throughput.py " + " ".join(argv or sys.argv[1:]),
        "workload": {"source": base.source, "elements": base.elements,
                     "max_atoms": base.max_atoms, "sampler": "rattle",
                     "sigma": base.rattle_sigma, "method": spec.level + " (tblite)",
                     "calculator_settings": spec.settings, "frames": len(items),
                     "mean_atoms": sum(len(i.numbers) for i in items) / len(items)},
        "repeats": args.repeats,
        "threads": threads,
        "serial": {"runs": serial, "best_wall_s": serial_wall,
                   "frames_per_s": len(items) / serial_wall,
                   "best_cpu_s": min(r["cpu_s"] for r in serial)},
        "plain_processes": {"runs": plain, "best_wall_s": plain_wall,
                            "frames_per_s": len(items) / plain_wall,
                            "hardware_scaling": hardware},
        "cluster_startup_s": startup,
        "campaign": summary,
        "campaign_runs": runs,
        "best": {"chunk_size": best["chunk_size"],
                 "serial_frames_per_s": len(items) / serial_wall,
                 "campaign_frames_per_s": best["frames_per_s"],
                 "parallel_efficiency": best["parallel_efficiency"],
                 "parallel_efficiency_median": best["parallel_efficiency_median"],
                 "overhead_per_task_s": best["overhead_per_task_s"],
                 "driver_cpu_s": best["driver_cpu_s"],
                 "cpu_efficiency": best["cpu_efficiency"],
                 "framework_efficiency_vs_plain_processes":
                     best["framework_efficiency_vs_plain_processes"],
                 "hardware_scaling_plain_processes": hardware,
                 "cluster_startup_s": startup,
                 "target": 0.85, "met": best["parallel_efficiency"] >= 0.85},
        "machine": {**machine, "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg()},
        "versions": _versions(),
        "note": ("Best of N interleaved runs on each side (least disturbed by other load), "
                 "medians alongside. parallel_efficiency = campaign frames/s / (workers x "
                 "serial frames/s), the target metric; the campaign also writes and "
                 "checksums the dataset, the serial loop writes nothing. hardware_scaling = "
                 "the same ratio for plain processes without Dask or writing: the ceiling "
                 "the machine allowed at the time. cpu_efficiency = serial CPU s / (driver "
                 "+ workers CPU s). fixed_s = campaign wall outside the task farm. A "
                 "loadavg above ~2 means other work shared the 2 cores."),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from convergent.provenance import code_version

    out.write_text(json.dumps({**result, "code": code_version().to_dict()}, indent=2))
    print(json.dumps(result["best"]), f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
