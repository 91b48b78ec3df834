"""DDP gradient compression: bytes communicated per step and final loss.

One run, same machine, same model/data/seed, DDP with 2 processes x 1 thread (gloo):
``none`` (fp32 all-reduce) vs ``fp16`` vs ``powersgd`` (rank 2, error feedback, plain
all-reduce for the first 10 steps) vs ``topk`` (ours: 1% of entries + error feedback).

Two models: the Llama-style LM (synthetic Markov-chain tokens; loss = cross-entropy)
and the molecular surrogate (generated EMT data; loss = energy + forces).

Bytes are the gradient payload this rank contributed per step as counted by the
instrumented comm hooks (fp32 all-reduce: 4 B/element; fp16: 2 B; top-k: 8 B per kept
entry (value + index); PowerSGD: its P and Q factors plus the uncompressed vectors).
The wire traffic of a ring all-reduce is about 2x(n-1)/n of the payload for all-reduce
hooks, (n-1)x the payload for top-k's all-gather.

Usage: ``python bench/compression.py [--steps 80]`` (writes bench/results/compression.json).
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

METHODS = {
    "none": ["parallel.compression=none"],
    "fp16": ["parallel.compression=fp16"],
    "powersgd": ["parallel.compression=powersgd", "parallel.powersgd_rank=2",
                 "parallel.powersgd_start_iter=10"],
    "topk": ["parallel.compression=topk", "parallel.topk_ratio=0.01"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--molecules", type=int, default=300)
    args = ap.parse_args()
    import torch
    from train_throughput import make_dataset

    from convergent.config import load_config
    from convergent.runs import open_run
    from convergent.train.launch import launch_training

    tmp = Path(tempfile.mkdtemp(prefix="bench_comp_"))
    t0 = time.time()
    load_before = os.getloadavg()
    data = make_dataset(tmp / "data", args.molecules)
    common = [f"train.steps={args.steps}", "train.val_every=0", "checkpoint.interval=0",
              "metrics.tensorboard=false", "parallel.strategy=ddp", "train.warmup_steps=5"]
    models = {
        "llama_lm": ["model.kind=llama", "model.hidden=64", "model.layers=2", "model.heads=4",
                     "train.seq_len=32", "train.vocab_size=256", "train.global_batch_seqs=16",
                     "train.lr=3e-3", "train.val_max_batches=4"],
        "molecular": [f"train.dataset={data}", "train.global_batch_atoms=512"],
    }
    results: dict[str, dict] = {}
    for mname, mover in models.items():
        results[mname] = {}
        for meth, over in METHODS.items():
            print(f"{mname} / {meth} ...", flush=True)
            cfg = load_config(None, [*common, *mover, *over])
            run = open_run(cfg, tmp / f"{mname}_{meth}")
            try:
                res = launch_training(cfg, run, nproc=2)
            except Exception as exc:  # noqa: BLE001 - record and go on
                results[mname][meth] = {"error": str(exc)[:500]}
                continue
            recs = run.read_metrics("train_step")
            tail = recs[-10:]
            entry = {
                "bytes_per_step_median": statistics.median(r["comm_bytes"] for r in recs[12:]),
                "bytes_per_step_first": recs[0]["comm_bytes"],
                "final_loss_mean_last10": statistics.fmean(r["loss"] for r in tail),
                "final_loss": recs[-1]["loss"],
                "loss_curve_every10": [r["loss"] for r in recs[::10]],
                "median_step_s": statistics.median(r["step_s"] for r in recs[5:]),
                "median_comm_s": statistics.median(r["comm_s"] for r in recs[5:]),
                "val": res.val,
            }
            results[mname][meth] = entry
            print(f"  bytes/step {entry['bytes_per_step_median']:.0f} "
                  f"final loss {entry['final_loss_mean_last10']:.4g}", flush=True)
        base = results[mname].get("none", {}).get("bytes_per_step_median")
        for e in results[mname].values():
            if base and "bytes_per_step_median" in e:
                e["compression_ratio_vs_none"] = base / max(e["bytes_per_step_median"], 1)
    out = {
        "benchmark": "compression",
        "description": __doc__.split("\n\n")[1].replace("\n", " "),
        "settings": {"steps": args.steps, "processes": 2, "threads_per_process": 1,
                     "backend": "gloo", "methods": METHODS, "models": models},
        "results": results,
        "machine": {"platform": platform.platform(), "usable_cpus": len(os.sched_getaffinity(0)),
                    "load_avg_before": load_before, "load_avg_after": os.getloadavg()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "note": "bytes are exact accounting of the hook payloads; losses are from one seed; "
                "times depend on the machine's load (machine.load_avg_*) and on 2 local processes compression "
                "cannot pay off in time, only in bytes",
        "seconds": time.time() - t0,
    }
    dest = HERE / "results" / "compression.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    from convergent.provenance import code_version

    dest.write_text(json.dumps({**out, "code": code_version().to_dict()}, indent=2))
    print(f"wrote {dest}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
