"""Training throughput: convergent vs plain PyTorch DDP vs Lightning Fabric vs HF Accelerate.

One run, same machine, same model (the molecular surrogate, default ``model`` config),
same data (a generated EMT dataset, identical per-rank batches from the same global
atom-budget plan), same optimizer (AdamW, grad clip 10), same loss (energy + forces, so
every step is a double backward). Compared:

* ours (``convergent.train``, DDP, 2 processes x 1 thread), fp32 and bf16;
* ours, 1 process x 2 threads (``strategy: single``, ``train.threads: 2``), fp32;
* a plain idiomatic PyTorch DDP loop, Lightning Fabric (``strategy="ddp"``) and
  Hugging Face Accelerate, each 2 processes x 1 thread under torchrun, fp32 and bf16.

Step times are wall clock per loop iteration for every system (for ours: from one
step's start to the next one's, so metric bookkeeping between the trainer's timed
sections is included; the trainer's own ``step_s`` median is listed beside it).

Reported per configuration: median step time over the steps after warm-up, samples/s
(molecules), atoms/s, and MFU = counted model FLOPs (FlopCounterMode on one step, per
atom) x atoms/s / (measured single-thread GEMM peak for the dtype x processes; for the
1x2 run the 2-thread peak). The machine is shared (other jobs run), so numbers are noisy;
the load average before/after is in the JSON.

Every configuration runs once per round, interleaved (A B C ... A B C ...) for
``--rounds`` rounds (bench/lib/harness.py); each number is the median over rounds with its
spread (never the best round). All sides get the same DDP options (bucket 25 MB,
``broadcast_buffers=False``: the model's buffers are fixed at build time), the same
constant learning rate (no warm-up or schedule), 1 torch thread per process and the same
batches; the differences that remain are listed in the JSON's ``differences``.

Usage: ``python -m bench.train.throughput [--steps 40] [--molecules 400] [--rounds 3]
[--only ddp_2x1_fp32] [--out bench/results/train_throughput.json] [--allow-dirty]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.harness import Side, add_args, check_clean, interleave, write_result
from bench.lib.paths import RESULTS, child_env

NAMES = ["H2O", "CH4", "NH3", "C2H6", "CH3OH", "C2H4", "HCN", "CO2", "H2CO", "C2H2", "CH3CN",
         "C3H8", "CH3CHO", "CH3CH2OH", "HCOOH", "CH3COOH", "C6H6"]


def make_dataset(root: Path, n: int, seed: int = 0) -> Path:
    """``n`` rattled small molecules with EMT energies/forces (fast, deterministic)."""
    import numpy as np
    from ase.build import molecule
    from ase.calculators.emt import EMT

    from convergent.data.writer import write_records

    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        atoms = molecule(NAMES[i % len(NAMES)])
        atoms.positions += rng.normal(0, 0.08, atoms.positions.shape)
        atoms.calc = EMT()
        recs.append({
            "key": f"m{i}", "molecule_id": NAMES[i % len(NAMES)],
            "numbers": atoms.numbers.astype(np.int64),
            "positions": atoms.positions.astype(np.float64),
            "energy": float(atoms.get_potential_energy()),
            "forces": atoms.get_forces().astype(np.float64),
        })
    write_records(root / "train", recs, compression="none")
    return root / "train"


def overrides(data: Path, steps: int, dtype: str) -> list[str]:
    return [
        f"train.dataset={data}", f"train.steps={steps}", "train.val_every=0",
        "checkpoint.interval=0", "metrics.tensorboard=false", f"precision.dtype={dtype}",
        "train.warmup_steps=0", "train.lr_schedule=constant", "metrics.log_every=1000",
        "train.global_batch_atoms=1024",
    ]


# ----------------------------------------------------------------------------- peers


def peer_worker(kind: str, data: str, steps: int, dtype: str, out: str) -> None:
    """One process of a peer loop (launched by torchrun)."""
    import torch
    import torch.distributed as dist

    from convergent.config import load_config
    from convergent.models.losses import energy_force_loss
    from convergent.models.molecular import energy_and_forces
    from convergent.train.tasks import MolecularTask

    torch.set_num_threads(1)
    cfg = load_config(None, overrides(Path(data), steps, dtype))
    task = MolecularTask(cfg)
    torch.manual_seed(0)
    model = task.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    bf16 = dtype == "bf16"
    if kind == "plain":
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        from torch.nn.parallel import DistributedDataParallel as DDP

        # the same DDP options as ours (convergent.train.parallel): default bucket size,
        # no buffer broadcast before each forward
        dmodel = DDP(model, broadcast_buffers=False)

        def backward(loss):
            loss.backward()

        def clip():
            torch.nn.utils.clip_grad_norm_(dmodel.parameters(), 10.0)

        def ctx():
            return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    elif kind == "fabric":
        from lightning.fabric import Fabric
        from lightning.fabric.strategies import DDPStrategy

        fabric = Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                        strategy=DDPStrategy(broadcast_buffers=False),
                        precision="bf16-mixed" if bf16 else "32-true")
        fabric.launch()
        rank, world = fabric.global_rank, fabric.world_size
        dmodel, opt = fabric.setup(model, opt)

        def backward(loss):
            fabric.backward(loss)

        def clip():
            fabric.clip_gradients(dmodel, opt, max_norm=10.0)

        def ctx():
            return fabric.autocast()
    elif kind == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs

        acc = Accelerator(cpu=True, mixed_precision="bf16" if bf16 else "no",
                          kwargs_handlers=[DistributedDataParallelKwargs(
                              broadcast_buffers=False)])
        rank, world = acc.process_index, acc.num_processes
        dmodel, opt = acc.prepare(model, opt)

        def backward(loss):
            acc.backward(loss)

        def clip():
            acc.clip_grad_norm_(dmodel.parameters(), 10.0)

        def ctx():
            return acc.autocast()
    else:
        raise SystemExit(f"unknown peer {kind}")
    times, atoms, mols = [], [], []
    for step in range(steps):
        t0 = time.perf_counter()
        mb = task.micro_batches(step, rank, world, 1)[0]
        batch = mb.data
        with ctx():
            energy, forces = energy_and_forces(dmodel, batch, training=True)
            loss, _ = energy_force_loss(energy, forces, batch, cfg.train.force_weight)
        backward(loss)
        clip()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        atoms.append(batch.num_atoms)
        mols.append(batch.n_molecules)
    t = torch.tensor([times, atoms, mols], dtype=torch.float64)
    if dist.is_initialized():
        gathered = [torch.zeros_like(t) for _ in range(world)]
        dist.all_gather(gathered, t)
    else:
        gathered = [t]
    if rank == 0:
        step_t = torch.stack([g[0] for g in gathered]).max(0).values.tolist()
        glob_atoms = torch.stack([g[1] for g in gathered]).sum(0).tolist()
        glob_mols = torch.stack([g[2] for g in gathered]).sum(0).tolist()
        Path(out).write_text(json.dumps({"step_s": step_t, "atoms": glob_atoms,
                                         "molecules": glob_mols, "world": world}))
    if dist.is_initialized():
        dist.barrier()


def run_peer(kind: str, data: Path, steps: int, dtype: str, tmp: Path) -> dict:
    out = tmp / f"{kind}_{dtype}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
           "--nproc-per-node=2", "-m", __spec__.name, "--worker", kind,
           "--data", str(data), "--steps", str(steps), "--dtype", dtype, "--worker-out", str(out)]
    env = child_env(OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [x.split("]:", 1)[-1].strip() for x in proc.stderr.splitlines()
                 if "Error:" in x and "[rank0]" in x] or proc.stderr.splitlines()[-3:]
        raise RuntimeError(f"{kind} {dtype} failed: {' | '.join(lines[-3:])}")
    return json.loads(out.read_text())


# ----------------------------------------------------------------------------- ours


def run_ours(data: Path, steps: int, dtype: str, tmp: Path, nproc: int, threads: int,
             rep: int = 0) -> dict:
    from convergent.config import load_config
    from convergent.runsdb.rundir import open_run
    from convergent.runsdb.trainrecords import TIME_PARTS, read_train_records
    from convergent.train.launch import launch_training

    strategy = "single" if nproc == 1 else "ddp"
    cfg = load_config(None, [*overrides(data, steps, dtype), f"parallel.strategy={strategy}",
                             f"train.threads={threads}"])
    run = open_run(cfg, tmp / f"ours_{dtype}_{nproc}x{threads}_rep{rep}")
    launch_training(cfg, run, nproc=nproc)
    recs, _ = read_train_records(run.metrics)
    # wall-clock per step like the peers' loops: start-to-start, so the metrics
    # bookkeeping between timed steps is included (the last step: its own step_s)
    starts = [r.start_time for r in recs]
    wall = [b - a for a, b in zip(starts, starts[1:], strict=False)] + [recs[-1].step_s]
    return {
        "step_s": wall,
        "trainer_step_s_median": statistics.median(r.step_s for r in recs[5:]),
        "atoms": [r.units_per_s * r.step_s for r in recs],
        "molecules": [r.samples_per_s * r.step_s for r in recs],
        "world": nproc,
        "time_breakdown_median_s": {
            k: statistics.median(getattr(r, k) for r in recs[5:]) for k in TIME_PARTS
        },
    }


# ----------------------------------------------------------------------------- summary


def flops_per_atom(data: Path, dtype: str) -> float:
    import torch

    from convergent.config import load_config
    from convergent.monitor.flops import count_flops
    from convergent.train import precision
    from convergent.train.tasks import MolecularTask

    cfg = load_config(None, overrides(data, 1, dtype))
    task = MolecularTask(cfg)
    torch.manual_seed(0)
    model = task.build_model()
    mb = task.micro_batches(0, 0, 1, 1)[0]

    def step():
        with precision.autocast(dtype, "cpu"):
            loss, _ = task.loss(model, mb, 1)
        loss.backward()

    _, f = count_flops(step)
    return f / mb.units


def peak(dtype: str, threads: int) -> float:
    """Best GEMM peak seen on this machine for (dtype, threads): a new measurement and
    the cache of :func:`convergent.monitor.flops.measured_cpu_peak` (which keeps the max)."""
    import torch

    from convergent.monitor.flops import measured_cpu_peak

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return max(measured_cpu_peak(dtype).flops for _ in range(2))
    finally:
        torch.set_num_threads(old)


def summarize(raw: dict, warmup: int, fpa: float, peak_flops: float, threads: int) -> dict:
    idx = range(warmup, len(raw["step_s"]))
    step = statistics.median(raw["step_s"][i] for i in idx)
    tot_t = sum(raw["step_s"][i] for i in idx)
    atoms_s = sum(raw["atoms"][i] for i in idx) / tot_t
    mols_s = sum(raw["molecules"][i] for i in idx) / tot_t
    world = raw["world"]
    out = {
        "processes": world, "threads_per_process": threads,
        "median_step_s": step, "samples_per_s": mols_s, "atoms_per_s": atoms_s,
        "mfu": fpa * atoms_s / (peak_flops * world),
    }
    if "time_breakdown_median_s" in raw:
        out["time_breakdown_median_s"] = raw["time_breakdown_median_s"]
        out["trainer_step_s_median"] = raw["trainer_step_s_median"]
    return out


DIFFERENCES = [
    "step time: for ours from one step's start to the next (the trainer's metric "
    "bookkeeping between steps included), for the peers one loop iteration",
    "ours runs its trainer (metrics JSONL, NaN guard, comm hook accounting); the peers "
    "are bare loops over the same batches",
    "ours_single_1x2_fp32 is 1 process x 2 threads; every other side 2 processes x 1 thread",
    "MFU divides by the best GEMM peak measured on this machine for the dtype and threads "
    "(before and after the runs): an underestimated peak would inflate MFU",
    "fabric bf16 fails on the double backward (fabric asks for fabric.backward on the "
    "inner autograd.grad); it is recorded as an error, not left out silently",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--data")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--molecules", type=int, default=400)
    ap.add_argument("--only", default="", help="comma-separated substrings of the "
                    "configuration names to run (default: all), e.g. 'ddp_2x1_fp32'")
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    add_args(ap, str(RESULTS / "train_throughput.json"), rounds=3)
    args = ap.parse_args()
    if args.worker:
        peer_worker(args.worker, args.data, args.steps, args.dtype, args.worker_out)
        return
    check_clean(args)
    tmp = Path(tempfile.mkdtemp(prefix="bench_train_"))
    data = make_dataset(tmp / "data", args.molecules)
    fpa = {d: flops_per_atom(data, d) for d in ("fp32", "bf16")}
    peaks = {(d, t): peak(d, t) for d in ("fp32", "bf16") for t in (1, 2)}
    plan = [
        ("ours_ddp_2x1_fp32", lambda r: run_ours(data, args.steps, "fp32", tmp, 2, 1, r),
         "fp32", 1, 2),
        ("ours_ddp_2x1_bf16", lambda r: run_ours(data, args.steps, "bf16", tmp, 2, 1, r),
         "bf16", 1, 2),
        ("ours_single_1x2_fp32", lambda r: run_ours(data, args.steps, "fp32", tmp, 1, 2, r),
         "fp32", 2, 1),
    ]
    for kind in ("plain", "fabric", "accelerate"):
        for d in ("fp32", "bf16"):
            plan.append((f"{kind}_ddp_2x1_{d}",
                         lambda r, k=kind, dd=d: run_peer(k, data, args.steps, dd, tmp), d, 1, 2))
    if args.only:
        keys = [k for k in args.only.split(",") if k]
        plan = [p for p in plan if any(k in p[0] for k in keys)]
    failed: dict[str, str] = {}

    def side(name, fn, dtype, threads):
        def run(r: int) -> dict:
            if name in failed:  # a deterministic failure: not retried every round
                return {"error": failed[name]}
            try:
                raw = fn(r)
            except Exception as exc:  # noqa: BLE001 - recorded; the other sides go on
                failed[name] = str(exc)[:400]
                return {"error": failed[name]}
            return summarize(raw, args.warmup, fpa[dtype], peaks[(dtype, threads)], threads)
        return run

    sides = [Side(name, side(name, fn, dtype, threads),
                  {"dtype": dtype, "processes": nproc, "threads_per_process": threads,
                   "ddp": {"broadcast_buffers": False, "bucket_cap_mb": 25} if nproc > 1 else None,
                   "overrides": overrides(data, args.steps, dtype)})
             for name, fn, dtype, threads, nproc in plan]
    res = interleave("train_throughput", sides, rounds=args.rounds, differences=DIFFERENCES)
    # the machine is shared: re-measure the GEMM peaks at the end and keep the best seen
    # (an underestimated peak would inflate MFU), then recompute every MFU with it
    for key in peaks:
        peaks[key] = max(peaks[key], peak(*key))
    results: dict[str, dict] = {}
    for name, _, dtype, threads, nproc in plan:
        rows = res.per_round[name]
        errors = [r["error"] for r in rows if "error" in r]
        if res.median(name, "samples_per_s") is None:
            results[name] = {"error": errors[0] if errors else "no run"}
            continue
        for r in rows:
            if "atoms_per_s" in r:
                r["mfu"] = fpa[dtype] * r["atoms_per_s"] / (peaks[(dtype, threads)] * nproc)
        out = {"dtype": dtype, "processes": nproc, "threads_per_process": threads}
        for k in ("median_step_s", "samples_per_s", "atoms_per_s", "trainer_step_s_median"):
            if res.median(name, k) is not None:
                out[k] = res.median(name, k)
        out["mfu"] = statistics.median(r["mfu"] for r in rows if "mfu" in r)
        out["samples_per_s_spread"] = res.summary[name]["samples_per_s"]
        if errors:
            out["errors"] = errors
        results[name] = out
    res.summarise()
    ref = results.get("ours_ddp_2x1_fp32", {}).get("samples_per_s")
    if ref:
        res.headline["ours_vs_peers_fp32"] = {
            n: ref / r["samples_per_s"] for n, r in results.items()
            if n.endswith("_fp32") and not n.startswith("ours") and r.get("samples_per_s")}
    res.headline["results"] = results
    res.extra = {"description": __doc__.split("\n\n")[1].replace("\n", " "),
                 "only": args.only or "all", "steps": args.steps,
                 "warmup_steps_excluded": args.warmup, "molecules": args.molecules,
                 "model": "molecular default (hidden 64, 3 layers)",
                 "global_batch_atoms": 1024, "loss": "energy+forces (double backward)",
                 "flops_per_atom": fpa,
                 "measured_gemm_peak_flops": {f"{d}_{t}threads": v for (d, t), v in peaks.items()},
                 "note": "2-core machine; timings depend on its load (provenance, per_round "
                         "load1); compare configurations within this file only"}
    write_result(res, args)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
