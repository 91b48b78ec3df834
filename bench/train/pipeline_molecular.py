"""Molecular surrogate with direct forces: pipeline parallelism vs the other strategies.

One run, same machine, same model (``model.forces: direct``), data, seed and global
batch: ``single`` (1 process x 2 threads) vs ``ddp`` (2 processes x 1 thread) vs
``pipeline`` GPipe and 1F1B (2 processes = 2 stages x 1 thread, 4 padded micro-batches).
Runs are interleaved (A, B, C, D, A, B, ...) for ``--rounds`` rounds by bench/lib/harness.py
so machine load hits all alike; every metric is the median over rounds with its spread,
and the JSON keeps every run with the load average after it.

Reported per strategy: median atoms/s over steps after warm-up (real atoms, not padding),
final loss (the strategies agree up to summation order) and, for the pipeline, the
padding overhead: padded atom slots per step / real atoms per step.

Usage: ``python -m bench.train.pipeline_molecular [--steps 40] [--rounds 3] [--allow-dirty]`` (writes
bench/results/pipeline_molecular.json).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

from bench.lib.harness import Side, add_args, check_clean, interleave, write_result
from bench.lib.paths import RESULTS

STRATEGIES = {
    "single": (1, ["parallel.strategy=single", "train.threads=2"]),
    "ddp": (2, ["parallel.strategy=ddp", "train.threads=1"]),
    "pipeline_gpipe": (2, ["parallel.strategy=pipeline", "parallel.schedule=gpipe",
                           "train.threads=1"]),
    "pipeline_1f1b": (2, ["parallel.strategy=pipeline", "parallel.schedule=1f1b",
                          "train.threads=1"]),
}


def one_run(cfg, nproc: int, path: Path, pipeline: bool, n_micro: int) -> dict:
    from convergent.runsdb.rundir import open_run
    from convergent.runsdb.trainrecords import read_train_records
    from convergent.train.launch import launch_training

    run = open_run(cfg, path)
    try:
        launch_training(cfg, run, nproc=nproc)
    except Exception as exc:  # noqa: BLE001 - recorded; the other sides go on
        return {"error": str(exc)[:500]}
    recs, _ = read_train_records(run.metrics)
    warm = recs[5:] or recs
    entry = {
        "atoms_per_s_median": statistics.median(r.units_per_s for r in warm),
        "step_s_median": statistics.median(r.step_s for r in warm),
        "comm_s_median": statistics.median(r.comm_s for r in warm),
        "final_loss": recs[-1].loss,
    }
    if pipeline:
        entry["padding_overhead"] = _padding_overhead(cfg, n_micro)
    shutil.rmtree(path, ignore_errors=True)
    return entry


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--molecules", type=int, default=300)
    ap.add_argument("--global-atoms", type=int, default=512)
    ap.add_argument("--microbatches", type=int, default=4)
    add_args(ap, str(RESULTS / "pipeline_molecular.json"), rounds=3)
    args = ap.parse_args()
    check_clean(args)
    from bench.train.throughput import make_dataset
    from convergent.config import load_config

    tmp = Path(tempfile.mkdtemp(prefix="bench_pp_mol_"))
    data = make_dataset(tmp / "data", args.molecules)
    common = [
        f"train.dataset={data}", f"train.steps={args.steps}", "train.val_every=0",
        "checkpoint.interval=0", "checkpoint.export_final=false", "metrics.tensorboard=false",
        "model.forces=direct", "model.hidden=64", "model.layers=4", "train.warmup_steps=5",
        f"train.global_batch_atoms={args.global_atoms}",
        f"parallel.microbatches={args.microbatches}",
    ]
    sides = []
    for name, (nproc, over) in STRATEGIES.items():
        cfg = load_config(None, [*common, *over])

        def run(r: int, cfg=cfg, nproc=nproc, name=name) -> dict:
            return one_run(cfg, nproc, tmp / f"{name}_{r}", name.startswith("pipeline"),
                           args.microbatches)

        sides.append(Side(name, run, {"processes": nproc, "overrides": [*common, *over]}))
    res = interleave("pipeline_molecular", sides, rounds=args.rounds, differences=[
        "single runs 1 process x 2 threads, the others 2 processes x 1 thread (the same 2 "
        "cores)",
        "the pipeline sides pad each of the micro-batches to a fixed atom/edge budget "
        "(padding_overhead); single and ddp run unpadded batches of the same global atom "
        "budget",
        "ddp is torch DDP with broadcast_buffers=False (the model's buffers: radial "
        "centres, per-element reference energies, scale and shift, are set at build time "
        "and never change in training); the pipeline sides do not use DDP"])
    summary = {}
    for name in STRATEGIES:
        if res.median(name, "atoms_per_s_median") is None:
            continue
        summary[name] = {
            "atoms_per_s_median_of_runs": res.median(name, "atoms_per_s_median"),
            "atoms_per_s_spread": res.summary[name]["atoms_per_s_median"],
            "step_s_median_of_runs": res.median(name, "step_s_median"),
            "final_loss": res.median(name, "final_loss"),
        }
    res.headline["summary"] = summary
    res.extra = {"description": __doc__.split("\n\n")[1].replace("\n", " "),
                 "steps": args.steps, "molecules": args.molecules,
                 "global_batch_atoms": args.global_atoms, "microbatches": args.microbatches,
                 "common": common}
    write_result(res, args)
    shutil.rmtree(tmp, ignore_errors=True)


def _padding_overhead(cfg, n_micro: int) -> dict:
    """Padded atom slots per step vs the global atom budget (the upper bound of real atoms)."""
    from convergent.train.tasks import MolecularTask

    task = MolecularTask(cfg)
    budget = task.feed().budget
    return {"atom_slots_per_microbatch": budget.atoms, "edge_slots_per_microbatch": budget.edges,
            "atom_slots_per_step": budget.atoms * n_micro,
            "global_batch_atoms": task.global_budget(1, 1),
            "slots_per_budget_atom": budget.atoms * n_micro / task.global_budget(1, 1)}


if __name__ == "__main__":
    main()
