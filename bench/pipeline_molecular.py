"""Molecular surrogate with direct forces: pipeline parallelism vs the other strategies.

One run, same machine, same model (``model.forces: direct``), data, seed and global
batch: ``single`` (1 process x 2 threads) vs ``ddp`` (2 processes x 1 thread) vs
``pipeline`` GPipe and 1F1B (2 processes = 2 stages x 1 thread, 4 padded micro-batches).
Runs alternate (A, B, C, D, A, B, ...) for ``--rounds`` rounds so machine load hits all
alike; the JSON keeps every run with the load average around it.

Reported per strategy: median atoms/s over steps after warm-up (real atoms, not padding),
final loss (the strategies agree up to summation order) and, for the pipeline, the
padding overhead: padded atom slots per step / real atoms per step.

Usage: ``python bench/pipeline_molecular.py [--steps 40] [--rounds 2]`` (writes
bench/results/pipeline_molecular.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

STRATEGIES = {
    "single": (1, ["parallel.strategy=single", "train.threads=2"]),
    "ddp": (2, ["parallel.strategy=ddp"]),
    "pipeline_gpipe": (2, ["parallel.strategy=pipeline", "parallel.schedule=gpipe"]),
    "pipeline_1f1b": (2, ["parallel.strategy=pipeline", "parallel.schedule=1f1b"]),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--molecules", type=int, default=300)
    ap.add_argument("--global-atoms", type=int, default=512)
    ap.add_argument("--microbatches", type=int, default=4)
    args = ap.parse_args()
    import torch
    from train_throughput import make_dataset

    from convergent.config import load_config
    from convergent.runs import open_run
    from convergent.train.launch import launch_training

    tmp = Path(tempfile.mkdtemp(prefix="bench_pp_mol_"))
    t0 = time.time()
    data = make_dataset(tmp / "data", args.molecules)
    common = [
        f"train.dataset={data}", f"train.steps={args.steps}", "train.val_every=0",
        "checkpoint.interval=0", "checkpoint.export_final=false", "metrics.tensorboard=false",
        "model.forces=direct", "model.hidden=64", "model.layers=4", "train.warmup_steps=5",
        f"train.global_batch_atoms={args.global_atoms}",
        f"parallel.microbatches={args.microbatches}",
    ]
    runs: list[dict] = []
    for rnd in range(args.rounds):
        for name, (nproc, over) in STRATEGIES.items():
            print(f"round {rnd} / {name} ...", flush=True)
            cfg = load_config(None, [*common, *over])
            run = open_run(cfg, tmp / f"{name}_{rnd}")
            load_before = os.getloadavg()
            try:
                launch_training(cfg, run, nproc=nproc)
            except Exception as exc:  # noqa: BLE001 - record and go on
                runs.append({"strategy": name, "round": rnd, "error": str(exc)[:500]})
                continue
            recs = run.read_metrics("train_step")
            warm = recs[5:] or recs
            entry = {
                "strategy": name, "round": rnd, "processes": nproc,
                "atoms_per_s_median": statistics.median(r["atoms_per_s"] for r in warm),
                "step_s_median": statistics.median(r["step_s"] for r in warm),
                "comm_s_median": statistics.median(r["comm_s"] for r in warm),
                "final_loss": recs[-1]["loss"],
                "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
            }
            if name.startswith("pipeline"):
                entry["padding_overhead"] = _padding_overhead(cfg, args.microbatches)
            runs.append(entry)
            print(f"  atoms/s {entry['atoms_per_s_median']:.0f} loss {entry['final_loss']:.4g}",
                  flush=True)
    summary = {}
    for name in STRATEGIES:
        ok = [r for r in runs if r["strategy"] == name and "error" not in r]
        if ok:
            summary[name] = {
                "atoms_per_s_median_of_runs": statistics.median(r["atoms_per_s_median"] for r in ok),
                "final_loss": ok[-1]["final_loss"],
            }
    out = {
        "benchmark": "pipeline_molecular",
        "description": __doc__.split("\n\n")[1].replace("\n", " "),
        "settings": {"steps": args.steps, "rounds": args.rounds, "molecules": args.molecules,
                     "global_batch_atoms": args.global_atoms,
                     "microbatches": args.microbatches, "strategies": STRATEGIES,
                     "common": common},
        "summary": summary,
        "runs": runs,
        "machine": {"platform": platform.platform(),
                    "usable_cpus": len(os.sched_getaffinity(0))},
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "seconds": time.time() - t0,
    }
    dest = HERE / "results" / "pipeline_molecular.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    from convergent.provenance import code_version

    dest.write_text(json.dumps({**out, "code": code_version().to_dict()}, indent=2))
    print(f"wrote {dest}")
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
