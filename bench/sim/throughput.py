"""Simulation throughput: a plain serial GFN2-xTB loop vs the Dask campaign on 2 workers.

    python -m bench.sim.throughput                 # ~3 minutes on a quiet 2-core machine
    python -m bench.sim.throughput --frames 2000 --chunk-sizes 100,10 --rounds 3 --allow-dirty

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

The sides are interleaved (serial, plain, each chunk size; for ``--rounds`` rounds, by
bench/lib/harness.py) so load from other work on a shared machine hits all alike;
``os.getloadavg()`` is recorded around each run, and every number is the median over
rounds with its spread (never the best round).

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
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

from bench.lib.harness import Side, add_args, check_clean, interleave, write_result
from bench.lib.paths import RESULTS

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
    from convergent.cluster.resources import cpu_name, usable_cpus

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


def _summarise(res, cs: int, n: int, serial_cpu: float) -> dict:
    """Medians over rounds of one chunk size's campaign runs, with the efficiencies."""
    side = f"campaign_c{cs}"
    keys = ("frames_per_s", "wall_s", "fixed_s", "overhead_per_task_s",
            "worker_side_overhead_per_task_s", "worker_utilisation", "driver_cpu_s",
            "driver_main_thread_cpu_s", "driver_other_threads_cpu_s", "driver_cpu_per_task_s",
            "worker_cpu_s", "tasks", "frames", "quarantined", "dataset_shards",
            "dataset_bytes")
    out: dict = {"chunk_size": cs, "workers": n}
    out.update({k: res.median(side, k) for k in keys})
    out["parallel_efficiency"] = res.ratio(side, "serial", "frames_per_s") / n
    out["framework_efficiency_vs_plain_processes"] = res.ratio(side, "plain_processes",
                                                                "frames_per_s")
    out["cpu_efficiency"] = serial_cpu / (out["driver_cpu_s"] + out["worker_cpu_s"])
    out["spread"] = {k: res.summary[side][k] for k in ("frames_per_s", "overhead_per_task_s",
                                                        "driver_cpu_s")}
    out["rounds"] = len(res.per_round[side])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=5000)
    ap.add_argument("--chunk-sizes", default="200,100,50,10",
                    help="campaign chunk sizes to run (frames per task)")
    ap.add_argument("--workers", type=int, default=2)
    add_args(ap, str(RESULTS / "sim_throughput.json"), rounds=3)
    args = ap.parse_args(argv)
    check_clean(args)
    for var in THREAD_VARS:
        os.environ[var] = "1"  # before tblite loads: one thread, like a Dask worker

    from convergent.cluster.pool import dask_client
    from convergent.sim.calculators import CalcSpec
    from convergent.sim.config import ClusterConfig, SimulateConfig

    chunks = [int(c) for c in args.chunk_sizes.split(",") if c.strip()]
    base = SimulateConfig(frames=args.frames)
    spec = CalcSpec.from_simulate(base)
    items = _frames(base)
    serial_loop(items[:20], spec)  # warm-up: imports, parameter files

    tmp = Path(tempfile.mkdtemp(prefix="sim_bench_"))
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
            sides = [
                Side("serial", lambda r: serial_loop(items, spec),
                     {"processes": 1, "threads": 1, "writes": False}),
                Side("plain_processes",
                     lambda r: plain_processes(pool, items, spec, args.workers),
                     {"processes": args.workers, "threads": 1, "writes": False}),
            ]
            for cs in chunks:
                sides.append(Side(
                    f"campaign_c{cs}",
                    lambda r, cs=cs: campaign(client, base.model_copy(update={"chunk_size": cs}),
                                              tmp / f"c{cs}"),
                    {"workers": args.workers, "threads_per_worker": 1, "chunk_size": cs,
                     "writes": "checksummed dataset (verified untimed after each run)"}))
            res = interleave("sim_throughput", sides, rounds=args.rounds, differences=[
                "the campaign writes and checksums the dataset (shards, manifest); the "
                "serial loop and the plain processes write nothing",
                "the campaign's Dask cluster is started once before the rounds (start-up "
                "reported as cluster_startup_s, not in any wall time)",
                "every side runs the same frames with the same calculator settings and 1 "
                "OpenMP/BLAS thread per process"])
    shutil.rmtree(tmp, ignore_errors=True)

    n = args.workers
    serial_cpu = res.median("serial", "cpu_s")
    summary = [_summarise(res, cs, n, serial_cpu) for cs in chunks]
    best = max(summary, key=lambda r: r["parallel_efficiency"])
    hardware = res.ratio("plain_processes", "serial", "frames_per_s") / n
    res.headline.update({
        "workload": {"source": base.source, "elements": base.elements,
                     "max_atoms": base.max_atoms, "sampler": "rattle",
                     "sigma": base.rattle_sigma, "method": spec.level + " (tblite)",
                     "calculator_settings": spec.settings, "frames": len(items),
                     "mean_atoms": sum(len(i.numbers) for i in items) / len(items)},
        "best": {"chunk_size": best["chunk_size"],
                 "chosen_by": "the chunk size with the highest median parallel_efficiency",
                 "serial_frames_per_s": res.median("serial", "frames_per_s"),
                 "campaign_frames_per_s": best["frames_per_s"],
                 "parallel_efficiency": best["parallel_efficiency"],
                 "parallel_efficiency_median": best["parallel_efficiency"],
                 "overhead_per_task_s": best["overhead_per_task_s"],
                 "driver_cpu_s": best["driver_cpu_s"],
                 "cpu_efficiency": best["cpu_efficiency"],
                 "framework_efficiency_vs_plain_processes":
                     best["framework_efficiency_vs_plain_processes"],
                 "hardware_scaling_plain_processes": hardware,
                 "cluster_startup_s": startup,
                 "target": 0.85, "met": best["parallel_efficiency"] >= 0.85},
        "campaign": summary,
        "serial": {"frames_per_s": res.median("serial", "frames_per_s"),
                   "cpu_s": serial_cpu, "spread": res.summary["serial"]["frames_per_s"]},
        "plain_processes": {"frames_per_s": res.median("plain_processes", "frames_per_s"),
                            "hardware_scaling": hardware,
                            "spread": res.summary["plain_processes"]["frames_per_s"]},
        "cluster_startup_s": startup,
    })
    res.extra = {"command": "python -m bench.sim.throughput " + " ".join(argv or sys.argv[1:]),
                 "threads": threads, "machine": _machine(), "versions": _versions(),
                 "note": ("Medians over interleaved rounds (spread beside them). "
                          "parallel_efficiency = median campaign frames/s / (workers x median "
                          "serial frames/s), the target metric; the campaign also writes and "
                          "checksums the dataset, the serial loop writes nothing. "
                          "hardware_scaling = the same ratio for plain processes without Dask "
                          "or writing: the ceiling the machine allowed at the time. "
                          "cpu_efficiency = serial CPU s / (driver + workers CPU s). fixed_s = "
                          "campaign wall outside the task farm. A loadavg above ~2 means other "
                          "work shared the 2 cores.")}
    write_result(res, args)
    print(json.dumps(res.headline["best"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
