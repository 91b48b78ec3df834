"""DDP gradient compression: bytes communicated per step and final loss.

Same machine, same model/data/seed, DDP with 2 processes x 1 thread (gloo):
``none`` (fp32 all-reduce) vs ``fp16`` vs ``powersgd`` (rank 2, error feedback, plain
all-reduce for the first 10 steps) vs ``topk`` (ours: 1% of entries + error feedback).
The runs are interleaved (every model/method once per round, for ``--rounds`` rounds,
bench/lib/harness.py) and each metric is the median over rounds with its spread.

Two models: the Llama-style LM (synthetic Markov-chain tokens; loss = cross-entropy)
and the molecular surrogate (generated EMT data; loss = energy + forces).

Bytes are the gradient payload this rank contributed per step as counted by the
instrumented comm hooks (fp32 all-reduce: 4 B/element; fp16: 2 B; top-k: 8 B per kept
entry (value + index); PowerSGD: its P and Q factors plus the uncompressed vectors).
The wire traffic of a ring all-reduce is about 2x(n-1)/n of the payload for all-reduce
hooks, (n-1)x the payload for top-k's all-gather.

Usage: ``python -m bench.train.compression [--steps 80] [--rounds 3] [--allow-dirty]`` (writes
bench/results/compression.json).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

from bench.lib.harness import Side, add_args, check_clean, interleave, write_result
from bench.lib.paths import RESULTS

METHODS = {
    "none": ["parallel.compression=none"],
    "fp16": ["parallel.compression=fp16"],
    "powersgd": ["parallel.compression=powersgd", "parallel.powersgd_rank=2",
                 "parallel.powersgd_start_iter=10"],
    "topk": ["parallel.compression=topk", "parallel.topk_ratio=0.01"],
}
METRICS = ("bytes_per_step_median", "bytes_per_step_first", "final_loss_mean_last10",
           "final_loss", "median_step_s", "median_comm_s")


def one_run(cfg, path: Path) -> dict:
    from convergent.runsdb.rundir import open_run
    from convergent.runsdb.trainrecords import read_train_records
    from convergent.train.launch import launch_training

    run = open_run(cfg, path)
    try:
        res = launch_training(cfg, run, nproc=2)
    except Exception as exc:  # noqa: BLE001 - recorded; the other sides go on
        return {"error": str(exc)[:500]}
    recs, _ = read_train_records(run.metrics)
    tail = recs[-10:]
    out = {
        "bytes_per_step_median": statistics.median(r.comm_bytes for r in recs[12:]),
        "bytes_per_step_first": recs[0].comm_bytes,
        "final_loss_mean_last10": statistics.fmean(r.loss for r in tail),
        "final_loss": recs[-1].loss,
        "loss_curve_every10": [r.loss for r in recs[::10]],
        "median_step_s": statistics.median(r.step_s for r in recs[5:]),
        "median_comm_s": statistics.median(r.comm_s for r in recs[5:]),
        "val": res.val,
    }
    shutil.rmtree(path, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--molecules", type=int, default=300)
    add_args(ap, str(RESULTS / "compression.json"), rounds=3)
    args = ap.parse_args()
    check_clean(args)
    from bench.train.throughput import make_dataset
    from convergent.config import load_config

    tmp = Path(tempfile.mkdtemp(prefix="bench_comp_"))
    data = make_dataset(tmp / "data", args.molecules)
    common = [f"train.steps={args.steps}", "train.val_every=0", "checkpoint.interval=0",
              "metrics.tensorboard=false", "parallel.strategy=ddp", "train.warmup_steps=5"]
    models = {
        "llama_lm": ["model.kind=llama", "model.hidden=64", "model.layers=2", "model.heads=4",
                     "train.seq_len=32", "train.vocab_size=256", "train.global_batch_seqs=16",
                     "train.lr=3e-3", "train.val_max_batches=4"],
        "molecular": [f"train.dataset={data}", "train.global_batch_atoms=512"],
    }
    sides = []
    for mname, mover in models.items():
        for meth, over in METHODS.items():
            ovr = [*common, *mover, *over]
            cfg = load_config(None, ovr)

            def run(r: int, cfg=cfg, name=f"{mname}_{meth}") -> dict:
                return one_run(cfg, tmp / f"{name}_r{r}")

            sides.append(Side(f"{mname}_{meth}", run,
                              {"overrides": ovr, "processes": 2, "threads_per_process": 1,
                               "backend": "gloo", "seed": cfg.train.seed}))
    res = interleave("compression", sides, rounds=args.rounds, differences=[
        "only the compression method differs between sides of a model (the hook and its "
        "settings: powersgd rank 2 with 10 plain all-reduce steps first, topk 1%); model, "
        "data, seed, steps, processes and threads are the same"])
    results: dict[str, dict] = {}
    for mname in models:
        results[mname] = {}
        for meth in METHODS:
            side = f"{mname}_{meth}"
            entry = {k: res.median(side, k) for k in METRICS}
            entry["spread"] = {k: res.summary[side].get(k) for k in
                               ("final_loss_mean_last10", "median_step_s", "median_comm_s")}
            errors = [r["error"] for r in res.per_round[side] if "error" in r]
            if errors:
                entry["errors"] = errors
            results[mname][meth] = entry
        base = results[mname]["none"].get("bytes_per_step_median")
        for e in results[mname].values():
            if base and e.get("bytes_per_step_median"):
                e["compression_ratio_vs_none"] = base / max(e["bytes_per_step_median"], 1)
    res.headline["results"] = results
    res.extra = {"description": __doc__.split("\n\n")[1].replace("\n", " "),
                 "steps": args.steps, "molecules": args.molecules, "methods": METHODS,
                 "models": models,
                 "note": "bytes are exact accounting of the hook payloads (the same every round); "
                         "losses are from one seed; times depend on the machine's load "
                         "(provenance.load_avg_*, per_round load1) and on 2 local processes "
                         "compression cannot pay off in time, only in bytes"}
    write_result(res, args)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
