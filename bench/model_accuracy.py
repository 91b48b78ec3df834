"""Accuracy at equal training budget: our Transformer vs SchNet and PaiNN (schnetpack),
plus bf16 vs fp32 (throughput and MAE) for our model, in the same run.

Data (``--dataset``): GFN2-xTB energies/forces (tblite). ``nci`` (default): the NCI
compounds shipped with RDKit that are neutral, H/C/N/O/F and <= 20 atoms (544
compounds), 8 structures each (ETKDGv3 + MMFF94 embeddings with their own seeds, so
torsions differ, then rattled). ``g2``: 62 rattled G2 molecules, 25 each (the earlier
benchmark; too few compounds: the score was decided by which compounds fell in a fold).
Molecule-wise K-fold cross-validation (default 5 folds, molecules shuffled with seed 0):
every compound is a test compound exactly once, and the per-fold numbers show the
spread. Every model gets the same CPU-time budget of single-threaded training per fold
(fair on a shared CPU; wall time also recorded), the same element reference energies
and scale (fitted on the fold's training set), the same loss (per-atom energy MSE +
force weight x force MSE; the default weight 0.01 balances the two terms, since energy
MAE is the headline), Adam with cosine decay over the budget (optional warm-up, optional
exponential moving average of the weights: the same recipe for every model), the same
atom-budget batches, and an LR picked per model from the same grid on held-out
*training* molecules of fold 0 (one probe per model, reused for every fold). ``ours``
is the model's default (silu-gated attention, no LayerNorm in the energy head);
``ours_softmax`` is the ablation of the weighting (softmax mean instead of the silu-gated
sum); ``ours_vectors`` adds the vector channel (``model.vectors``: bond angles,
PaiNN-style mixing). Each energy MAE is also split into each test molecule's mean
offset and the conformational error left after removing it. bf16 autocast of our model
runs on fold 0 and is compared with fp32 on the same fold. Each (model, fold) trains in
its own process, ``--jobs`` at a time (budgets are per-process CPU time). The training
loop is bench/molbench.py:train_for (written here, in-process; it uses the project's
batching and loss). With ``--dataset g2``, fold 0's fp32 model is saved as
bench/data/xtb_pretrained for bench/transfer.py.

Writes bench/results/model_accuracy.json (or ``--out``). Usage:
    .venv/bin/python bench/model_accuracy.py [--budget 100] [--probe-budget 12] [--folds 5]
The budget curve in bench/results/model_accuracy_fold0_{300,1000}s*.json is this with
``--fold-list 0 --budget 300|1000 --models ours,schnet,painn --no-save-pretrained --out ...``.
A CPU-second buys fewer steps when more jobs than cores run (``--jobs 3`` on 2 cores
halved structures per CPU second): compare models within one run, not across runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from molbench import (  # noqa: E402
    DATA,
    OurPotential,
    SpkPotential,
    evaluate,
    molecule_folds,
    molecule_split,
    train_for,
    write_result,
    xtb_dataset,
    xtb_nci_dataset,
)

PEERS = ("schnet", "painn")
# --dataset: (records loader, description); both GFN2-xTB energies/forces from tblite
DATASETS = {
    "nci": (xtb_nci_dataset, "GFN2-xTB (tblite) on the NCI compounds shipped with RDKit: neutral, H/C/N/O/F, "
                             "<= 20 atoms, 8 structures each (ETKDGv3 + MMFF94 embeddings, rattled)"),
    "g2": (xtb_dataset, "GFN2-xTB (tblite) on rattled G2 molecules (closed shell, H/C/N/O/F, <= 12 atoms, 25 each)"),
}


def build(name: str, args: argparse.Namespace, ref):  # noqa: ANN001, ANN201
    from convergent.models.config import ModelConfig
    from convergent.models.molecular import build_model, count_parameters

    torch.manual_seed(0)
    if name.startswith("ours"):
        # ours_softmax / ours_silu: ablations of the attention weighting (else the model default)
        weights = next((w for w in ("softmax", "silu") if w in name), args.attention_weights)
        cfg = ModelConfig(hidden=args.hidden, layers=args.layers, heads=4, cutoff=args.cutoff,
                          vectors=args.vectors or "vectors" in name,
                          **({"attention_weights": weights} if weights else {}))
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


def fold_data(args: argparse.Namespace, fold: int):  # noqa: ANN201
    """(train, test) records of ``fold`` and the element references fitted on train."""
    from convergent.models.molecular import fit_reference_energies

    recs = DATASETS[args.dataset][0]()
    tr, te = molecule_folds(recs, args.folds, fold, seed=0)
    train, test = [recs[i] for i in tr], [recs[i] for i in te]
    return train, test, fit_reference_energies(train)


def recipe(args: argparse.Namespace, name: str) -> dict:
    return {"force_weight": args.force_weight, "ema_decay": args.ema, "sched_fn": schedule(args.warmup),
            "autocast": torch.bfloat16 if name.endswith("bf16") else None}


def run_probe(name: str, args: argparse.Namespace) -> dict:
    """Energy MAE per LR of the grid on held-out training molecules of fold 0."""
    train, _, ref = fold_data(args, 0)
    sub_tr, sub_val = molecule_split(train, 0.2, seed=1)
    rc = recipe(args, name)
    probe = {}
    for lr in args.lr_grid:
        pot, _, _ = build(name, args, ref)
        train_for(pot, [train[i] for i in sub_tr], args.probe_budget, lr=lr, **rc)
        probe[str(lr)] = evaluate(pot, [train[i] for i in sub_val], autocast=rc["autocast"])["energy_mae"]
        print(name, "probe lr", lr, probe[str(lr)], flush=True)
    return probe


def run_fold(name: str, fold: int, lr: float, args: argparse.Namespace) -> dict:
    """Train ``name`` on ``fold``'s training molecules for the budget; test MAE."""
    from convergent.models.io import save_model

    train, test, ref = fold_data(args, fold)
    rc = recipe(args, name)
    pot, n_params, cfg = build(name, args, ref)
    print(f"training {name} fold {fold} ({n_params} parameters) lr={lr} for {args.budget} CPU s", flush=True)
    tinfo = train_for(pot, train, args.budget, lr=lr, **rc)
    out = {"fold": fold, "n_train": len(train), "n_test": len(test),
           "test_molecules": sorted({r["molecule_id"] for r in test}), "parameters": n_params,
           "train": tinfo, "test": evaluate(pot, test, autocast=rc["autocast"])}
    if rc["autocast"] is not None:
        out["test_eval_fp32"] = evaluate(pot, test)
    if name == "ours" and fold == 0 and args.save_pretrained and args.dataset == "g2":
        save_model(pot.model, cfg, DATA / "xtb_pretrained",
                   extra={"trained_on": f"xtb_g2_25_0 fold 0 of {args.folds} (molecule-wise) train split",
                          "test": out["test"]})
    return out


def run_pool(cmds: list[list[str]], jobs: int) -> None:
    """Run ``cmds`` as subprocesses, at most ``jobs`` at a time; exit on a failure."""
    todo, running = list(cmds), []
    while todo or running:
        while todo and len(running) < jobs:
            running.append(subprocess.Popen(todo.pop(0)))
        time.sleep(1.0)
        for p in [p for p in running if p.poll() is not None]:
            running.remove(p)
            if p.returncode != 0:
                sys.exit(f"failed: {' '.join(p.args)}")


def cv_summary(folds: list[dict]) -> dict:
    """Pooled (over all test structures) and per-fold mean/std of the test MAEs."""
    n = np.array([f["n_test"] for f in folds], dtype=float)
    out = {"folds": [f["fold"] for f in folds], "n_test_total": int(n.sum())}
    for key in ("energy_mae", "energy_mae_per_atom", "energy_mae_molecule_offset",
                "energy_mae_within_molecule", "force_mae"):
        v = np.array([f["test"][key] for f in folds])
        # force MAE is per component; weighting by structures is close enough for the pool
        out[f"{key}_pooled"] = float((v * n).sum() / n.sum())
        out[f"{key}_fold_mean"] = float(v.mean())
        out[f"{key}_fold_std"] = float(v.std(ddof=1)) if len(v) > 1 else 0.0
        out[f"{key}_per_fold"] = v.tolist()
    out["diverged_folds"] = [f["fold"] for f in folds if f["train"].get("diverged_at_step") is not None
                             or not np.isfinite(f["test"]["energy_mae"])]
    out["train_structures_per_cpu_second_mean"] = float(np.mean([f["train"]["structures_per_cpu_second"] for f in folds]))
    return out


def summarize(results: dict) -> dict:
    """Ours vs the better peer (pooled CV MAE, per-fold ratios) and bf16 vs fp32 (fold 0)."""
    summary: dict = {}
    peers = [k for k in PEERS if k in results]
    if "ours" in results and peers:
        cv = {k: results[k]["cv"] for k in ["ours", *peers]}
        best = min(peers, key=lambda k: cv[k]["energy_mae_pooled"])
        ours_f = {f["fold"]: f["test"]["energy_mae"] for f in results["ours"]["folds"]}
        best_f = {f["fold"]: f["test"]["energy_mae"] for f in results[best]["folds"]}
        ratios = [ours_f[k] / best_f[k] for k in sorted(ours_f) if k in best_f]
        ratio = cv["ours"]["energy_mae_pooled"] / cv[best]["energy_mae_pooled"]
        summary = {
            "energy_mae_pooled": {k: v["energy_mae_pooled"] for k, v in cv.items()},
            "energy_mae_fold_mean_std": {k: [v["energy_mae_fold_mean"], v["energy_mae_fold_std"]] for k, v in cv.items()},
            "force_mae_pooled": {k: v["force_mae_pooled"] for k, v in cv.items()},
            # the energy error split: each test molecule's mean offset vs conformational error
            "energy_mae_molecule_offset_pooled": {k: v["energy_mae_molecule_offset_pooled"] for k, v in cv.items()},
            "energy_mae_within_molecule_pooled": {k: v["energy_mae_within_molecule_pooled"] for k, v in cv.items()},
            "best_peer": best,
            "ratio_ours_to_best_peer_pooled": ratio,
            "ratio_ours_to_best_peer_per_fold": ratios,
            "ratio_per_fold_mean_std": [float(np.mean(ratios)), float(np.std(ratios, ddof=1)) if len(ratios) > 1 else 0.0],
            "folds_ours_better_than": {k: sum(ours_f[f["fold"]] < f["test"]["energy_mae"] for f in results[k]["folds"])
                                       for k in peers},
            "criterion_ratio_le_0.8": ratio <= 0.8,
        }
    if "ours" in results and peers:
        best_mae = summary["energy_mae_pooled"][summary["best_peer"]]
        summary["every_variant_of_ours"] = {
            n: {"energy_mae_pooled": r["cv"]["energy_mae_pooled"], "force_mae_pooled": r["cv"]["force_mae_pooled"],
                "ratio_to_best_peer_pooled": r["cv"]["energy_mae_pooled"] / best_mae,
                "diverged_folds": r["cv"]["diverged_folds"]}
            for n, r in results.items() if n.startswith("ours") and len(r["folds"]) > 1}
    if "ours" in results and "ours_bf16" in results:
        a = next(f for f in results["ours"]["folds"] if f["fold"] == 0)
        b = next(f for f in results["ours_bf16"]["folds"] if f["fold"] == 0)
        summary["bf16_vs_fp32_fold0"] = {
            "train_throughput_ratio_bf16_over_fp32": b["train"]["structures_per_cpu_second"] / a["train"]["structures_per_cpu_second"],
            "inference_speedup_bf16_over_fp32": a["test"]["seconds_per_structure"] / b["test"]["seconds_per_structure"],
            "energy_mae_fp32": a["test"]["energy_mae"], "energy_mae_bf16": b["test"]["energy_mae"],
            "force_mae_fp32": a["test"]["force_mae"], "force_mae_bf16": b["test"]["force_mae"],
        }
    return summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="nci", choices=sorted(DATASETS),
                    help="nci: ~540 compounds (the headline); g2: 62 small molecules (saves xtb_pretrained)")
    ap.add_argument("--budget", type=float, default=100.0, help="CPU seconds per model and fold")
    ap.add_argument("--probe-budget", type=float, default=12.0, help="CPU seconds per LR probe")
    ap.add_argument("--lr-grid", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    ap.add_argument("--folds", type=int, default=5, help="molecule-wise cross-validation folds")
    ap.add_argument("--fold-list", type=int, nargs="+", help="run only these folds (default all)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--cutoff", type=float, default=5.0)
    ap.add_argument("--attention-weights", choices=["softmax", "silu"],
                    help="ours only (default: the model's default, silu, which is the headline)")
    ap.add_argument("--vectors", action=argparse.BooleanOptionalAction, default=False,
                    help="ours only: a vector channel per atom (model.vectors)")
    ap.add_argument("--force-weight", type=float, default=0.01,
                    help="loss = per-atom energy MSE + this x force MSE (0.01 balances the two terms "
                         "for these data; energy MAE is the headline)")
    ap.add_argument("--ema", type=float, default=0.99, help="EMA decay of the weights (0 = off)")
    ap.add_argument("--warmup", type=float, default=0.0, help="LR warm-up, fraction of the budget")
    ap.add_argument("--models", default="ours,schnet,painn,ours_softmax,ours_vectors,ours_bf16",
                    help="ours_silu / ours_softmax: our model with those attention weights (ablation); "
                         "ours_vectors: with the vector channel")
    ap.add_argument("--jobs", type=int, default=4, help="training processes at a time")
    ap.add_argument("--no-save-pretrained", dest="save_pretrained", action="store_false")
    ap.add_argument("--resume", action="store_true",
                    help="reuse the per-model/fold part files of an earlier run with the same --out and options")
    ap.add_argument("--out", type=Path, help="result path (default bench/results/model_accuracy.json)")
    ap.add_argument("--probe", help=argparse.SUPPRESS)  # internal: LR probe of one model
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: one model on --fold with --lr
    ap.add_argument("--fold", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--lr", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--part", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)

    if args.probe or args.one:
        res = run_probe(args.probe, args) if args.probe else run_fold(args.one, args.fold, args.lr, args)
        args.part.write_text(json.dumps(res))
        return
    names = args.models.split(",")
    if set(PEERS) & set(names) and importlib.util.find_spec("schnetpack") is None:
        print("model_accuracy: --models names a schnetpack peer but schnetpack is not installed; "
              "run: .venv/bin/pip install -e '.[bench]'", file=sys.stderr)
        sys.exit(2)
    load_start = os.getloadavg()
    recs = DATASETS[args.dataset][0]()  # built (and cached) once here, before the parallel workers read it
    folds = args.fold_list if args.fold_list is not None else list(range(args.folds))
    tag = (args.out.stem if args.out else "model_accuracy")
    part = lambda kind, n, k="": DATA / f"{tag}_{kind}_{n}{k}.json"  # noqa: E731
    base = [sys.executable, __file__, "--dataset", args.dataset, "--budget", str(args.budget), "--probe-budget", str(args.probe_budget),
            "--folds", str(args.folds), "--hidden", str(args.hidden), "--layers", str(args.layers),
            "--cutoff", str(args.cutoff), *(["--attention-weights", args.attention_weights] if args.attention_weights else []),
            "--vectors" if args.vectors else "--no-vectors",
            "--force-weight", str(args.force_weight), "--ema", str(args.ema), "--warmup", str(args.warmup),
            "--lr-grid", *map(str, args.lr_grid)]
    if not args.save_pretrained:
        base.append("--no-save-pretrained")
    probes: dict = {n: {str(args.lr_grid[0]): None} for n in names}
    if len(args.lr_grid) > 1:  # one LR probe per model, in parallel
        run_pool([[*base, "--probe", n, "--part", str(part("probe", n))] for n in names
                  if not (args.resume and part("probe", n).exists())], args.jobs)
        probes = {n: json.loads(part("probe", n).read_text()) for n in names}
    lrs = {n: float(min(p, key=lambda k: p[k] if p[k] is not None else 0.0)) for n, p in probes.items()}
    print("LR per model:", lrs, flush=True)
    # bf16 only on the first fold (its comparison with fp32 on the same fold is what's reported)
    jobs = [(n, k) for k in folds for n in names if not (n.endswith("bf16") and k != folds[0])]
    run_pool([[*base, "--one", n, "--fold", str(k), "--lr", str(lrs[n]), "--part", str(part("fold", n, k))]
              for n, k in jobs if not (args.resume and part("fold", n, k).exists())], args.jobs)
    results = {}
    for n in names:
        fl = [json.loads(part("fold", n, k).read_text()) for m, k in jobs if m == n]
        results[n] = {"parameters": fl[0]["parameters"], "lr": lrs[n], "lr_probe_val_energy_mae": probes[n],
                      "cv": cv_summary(fl), "folds": fl}
    summary = summarize(results)
    path = write_result("model_accuracy", {
        "data": {"dataset": args.dataset, "source": DATASETS[args.dataset][1], "structures": len(recs),
                 "molecules": len({r["molecule_id"] for r in recs}),
                 "split": f"molecule-wise {args.folds}-fold cross-validation (molecules shuffled, seed 0)",
                 "folds_run": folds},
        "protocol": {"budget_cpu_seconds_per_model_and_fold": args.budget, "hidden": args.hidden,
                     "layers": args.layers, "cutoff_A": args.cutoff, "ours_attention_weights": args.attention_weights or "model default (silu)",
                     "lr_grid": args.lr_grid, "lr_probe_cpu_seconds": args.probe_budget,
                     "lr_selection": "per model, energy MAE on 20% of the *training* molecules of fold 0",
                     "batch_atoms": 256, "force_weight": args.force_weight, "ema_decay": args.ema,
                     "warmup_fraction": args.warmup, "recipe_note": "the same trainer and recipe for every model",
                     "threads": 1, "parallel_processes": args.jobs, "bf16": "ours_bf16 on the first fold only",
                     "trainer": "bench/molbench.py:train_for (in-process, written for the bench)",
                     "schnetpack_note": "schnetpack 2.0.4 needs a one-line import shim on torch 2.13 (T_co)"},
        "load_avg_at_start": load_start,
        "results": results, "summary": summary,
    }, path=args.out)
    print(json.dumps(summary, indent=2))
    print("wrote", path)


if __name__ == "__main__":
    main()
