"""Accuracy at equal training budget: our Transformer vs SchNet and PaiNN (schnetpack),
plus bf16 vs fp32 (throughput and MAE) for our model, in the same run.

Data: GFN2-xTB energies/forces (tblite) of rattled G2 molecules (H/C/N/O/F, closed
shell, <= 12 atoms, 25 conformers each), one molecule-wise split (20 % of molecules held
out). Every model gets the same CPU-time budget of single-threaded training (fair on a
shared CPU; wall time also recorded), the same element reference energies and scale, the
same loss (per-atom energy MSE + force weight x force MSE), Adam with cosine decay over the
budget (optional warm-up, optional exponential moving average of the weights: the same
recipe for every model), the same atom-budget batches, and an LR picked from the same grid
on held-out training molecules. Models train in parallel processes (budgets are per-process CPU time). The training loop is bench/molbench.py:train_for (written
here, in-process; it uses the project's batching and loss).

Writes bench/results/model_accuracy.json. Usage:
    .venv/bin/python bench/model_accuracy.py [--budget 100] [--probe-budget 12] [--ema 0.99]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from molbench import (  # noqa: E402
    DATA,
    OurPotential,
    SpkPotential,
    evaluate,
    molecule_split,
    train_for,
    write_result,
    xtb_dataset,
)


def build(name: str, args: argparse.Namespace, ref):  # noqa: ANN001, ANN201
    from convergent.models.config import ModelConfig
    from convergent.models.molecular import build_model, count_parameters

    torch.manual_seed(0)
    if name.startswith("ours"):
        cfg = ModelConfig(hidden=args.hidden, layers=args.layers, heads=4, cutoff=args.cutoff)
        model = build_model(cfg)
        model.set_reference(ref)
        return OurPotential(model), count_parameters(model), cfg
    pot = SpkPotential(name, args.hidden, args.layers, args.cutoff, ref)
    return pot, sum(p.numel() for p in pot.parameters()), None


def schedule(warmup: float):  # noqa: ANN201
    """LR factor vs budget fraction: linear warm-up over ``warmup``, then cosine to 0."""
    import math

    def f(x: float) -> float:
        w = min(1.0, x / warmup) if warmup > 0 else 1.0
        return w * 0.5 * (1 + math.cos(math.pi * min(1.0, x)))

    return f


def run_one(name: str, args: argparse.Namespace) -> dict:
    """LR probe on a validation split of the training molecules, then the full budget."""
    from convergent.models.io import save_model
    from convergent.models.molecular import fit_reference_energies

    recs = xtb_dataset()
    tr, te = molecule_split(recs, 0.2, seed=0)
    train, test = [recs[i] for i in tr], [recs[i] for i in te]
    ref = fit_reference_energies(train)
    autocast = torch.bfloat16 if name.endswith("bf16") else None
    # LR chosen per model from the same grid, on held-out *training* molecules.
    sub_tr, sub_val = molecule_split(train, 0.2, seed=1)
    recipe = {"force_weight": args.force_weight, "ema_decay": args.ema, "sched_fn": schedule(args.warmup)}
    probe = {}
    for lr in args.lr_grid:
        pot, _, _ = build(name, args, ref)
        train_for(pot, [train[i] for i in sub_tr], args.probe_budget, lr=lr, autocast=autocast, **recipe)
        probe[lr] = evaluate(pot, [train[i] for i in sub_val], autocast=autocast)["energy_mae"]
        print(name, "probe lr", lr, probe[lr], flush=True)
    lr = min(probe, key=probe.get)
    pot, n_params, cfg = build(name, args, ref)
    print(f"training {name} ({n_params} parameters) lr={lr} for {args.budget} CPU s", flush=True)
    tinfo = train_for(pot, train, args.budget, lr=lr, autocast=autocast, **recipe)
    out = {"parameters": n_params, "lr": lr, "lr_probe_val_energy_mae": {str(k): v for k, v in probe.items()},
           "train": tinfo, "test": evaluate(pot, test, autocast=autocast)}
    if autocast is not None:
        out["test_eval_fp32"] = evaluate(pot, test)
    if name == "ours":
        save_model(pot.model, cfg, DATA / "xtb_pretrained",
                   extra={"trained_on": "xtb_g2_25_0 train split", "test": out["test"]})
    out["n_train"], out["n_test"] = len(train), len(test)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=100.0, help="CPU seconds per model")
    ap.add_argument("--probe-budget", type=float, default=12.0, help="CPU seconds per LR probe")
    ap.add_argument("--lr-grid", type=float, nargs="+", default=[1e-3, 3e-3])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--cutoff", type=float, default=5.0)
    ap.add_argument("--force-weight", type=float, default=10.0)
    ap.add_argument("--ema", type=float, default=0.99, help="EMA decay of the weights (0 = off)")
    ap.add_argument("--warmup", type=float, default=0.0, help="LR warm-up, fraction of the budget")
    ap.add_argument("--models", default="ours,schnet,painn,ours_bf16")
    ap.add_argument("--one", help="run one model and write its partial result (used internally)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    if args.one:
        res = run_one(args.one, args)
        (DATA / f"accuracy_{args.one}.json").write_text(json.dumps(res))
        return
    # Each model in its own process (in parallel): budgets are per-process CPU time.
    import subprocess

    names = args.models.split(",")
    base = [sys.executable, __file__, "--budget", str(args.budget), "--probe-budget", str(args.probe_budget),
            "--hidden", str(args.hidden), "--layers", str(args.layers), "--cutoff", str(args.cutoff),
            "--force-weight", str(args.force_weight), "--ema", str(args.ema), "--warmup", str(args.warmup),
            "--lr-grid", *map(str, args.lr_grid)]
    procs = {n: subprocess.Popen([*base, "--one", n]) for n in names}
    for n, p in procs.items():
        if p.wait() != 0:
            sys.exit(f"{n} failed")
    results = {n: json.loads((DATA / f"accuracy_{n}.json").read_text()) for n in names}
    n_train, n_test = results[names[0]]["n_train"], results[names[0]]["n_test"]

    peers = [results[k]["test"]["energy_mae"] for k in ("schnet", "painn") if k in results]
    summary = {}
    if "ours" in results and peers:
        best = min(peers)
        summary = {
            "ours_energy_mae": results["ours"]["test"]["energy_mae"],
            "best_peer_energy_mae": best,
            "ratio_ours_to_best_peer": results["ours"]["test"]["energy_mae"] / best,
            "criterion_ratio_le_0.8": results["ours"]["test"]["energy_mae"] <= 0.8 * best,
            "force_mae": {k: v["test"]["force_mae"] for k, v in results.items()},
        }
    if "ours" in results and "ours_bf16" in results:
        a, b = results["ours"], results["ours_bf16"]
        summary["bf16_vs_fp32"] = {
            "train_throughput_ratio_bf16_over_fp32": b["train"]["structures_per_cpu_second"] / a["train"]["structures_per_cpu_second"],
            "inference_speedup_bf16_over_fp32": a["test"]["seconds_per_structure"] / b["test"]["seconds_per_structure"],
            "energy_mae_fp32": a["test"]["energy_mae"], "energy_mae_bf16": b["test"]["energy_mae"],
            "force_mae_fp32": a["test"]["force_mae"], "force_mae_bf16": b["test"]["force_mae"],
        }
    path = write_result("model_accuracy", {
        "data": {"source": "GFN2-xTB (tblite) on rattled G2 molecules", "train_structures": n_train,
                 "test_structures": n_test, "split": "molecule-wise, 20% of molecules held out, seed 0"},
        "protocol": {"budget_cpu_seconds_per_model": args.budget, "hidden": args.hidden, "layers": args.layers,
                     "cutoff_A": args.cutoff, "lr_grid": args.lr_grid, "lr_probe_cpu_seconds": args.probe_budget,
                     "lr_selection": "per model, energy MAE on 20% of the *training* molecules",
                     "batch_atoms": 256, "force_weight": args.force_weight, "ema_decay": args.ema,
                     "warmup_fraction": args.warmup, "recipe_note": "the same trainer and recipe for every model",
                     "threads": 1, "parallel_processes": len(names),
                     "trainer": "bench/molbench.py:train_for (in-process, written for the bench)",
                     "schnetpack_note": "schnetpack 2.0.4 needs a one-line import shim on torch 2.13 (T_co)"},
        "results": results, "summary": summary,
    })
    print(json.dumps(summary, indent=2))
    print("wrote", path)


if __name__ == "__main__":
    main()
