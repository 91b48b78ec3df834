"""Transfer learning: fine-tune the xTB-pretrained surrogate on a small DFT set vs
training from scratch on the same small set; MAE on a held-out DFT test set.

DFT: PySCF B3LYP/6-31G* energies/forces of rattled small G2 molecules (<= 7 atoms, 3
conformers each, no fluorine), split molecule-wise (60 % of molecules for the small training set,
40 % held out). Pretrained model: bench/data/xtb_pretrained, trained by
``bench/model_accuracy.py --dataset g2`` on GFN2-xTB labels of the training molecules of its
cross-validation fold 0 (the bench's ``ours`` model: silu attention weights; cheap labels cover
many molecules, including some whose DFT labels are held out here: that is the intended
use of the cheap tier). Every variant gets the same CPU-time budget and the same batches;
fine-tuning refits the element reference energies on the DFT training set first
(convergent.models.transfer). Hyper-parameters (LR, force weight) are picked per variant
on a validation split carved from the DFT *training* molecules, never the test set.
"pretrained_refit_only" (zero-shot: pretrained network, refitted element references) is
the baseline a fine-tune must beat to be worth its cost.

Writes bench/results/transfer.json. Usage:
    .venv/bin/python bench/transfer.py [--budget 90] [--probe-budget 30] [--lr-grid ...]
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
    dft_dataset,
    evaluate,
    molecule_split,
    train_for,
    write_result,
)

BACKBONE_LR_MULT = 0.3


def make_variant(name: str, train: list, lr: float):  # noqa: ANN201
    """A fresh model (and optimiser) for ``name`` with references fitted on ``train``."""
    from convergent.models.io import load_model
    from convergent.models.molecular import build_model, fit_reference_energies
    from convergent.models.transfer import FinetuneConfig, freeze, param_groups

    torch.manual_seed(0)
    m, cfg = load_model(DATA / "xtb_pretrained")
    ref = fit_reference_energies(train)
    if name == "scratch":
        m = build_model(cfg)
        m.set_reference(ref)
        return m, torch.optim.Adam(m.parameters(), lr=lr), None
    # Pretrained network, element offsets refitted on the new labels (scale kept).
    ref.scale, ref.shift = float(m.scale), float(m.shift)
    m.set_reference(ref)
    if name == "pretrained_refit_only":
        return m, None, None
    fc = FinetuneConfig(freeze=name.split("_", 1)[1], lr=lr, backbone_lr_mult=BACKBONE_LR_MULT)
    freeze(m, fc.freeze)
    return m, torch.optim.AdamW(param_groups(m, fc.lr, fc.backbone_lr_mult), weight_decay=0.0), fc


def fit(m, opt, records: list, budget: float, force_weight: float) -> dict:  # noqa: ANN001
    from convergent.models.transfer import lr_factor

    def sched(frac: float) -> float:  # 5 % linear warm-up, then cosine to 0
        return lr_factor(int(frac * 1000), 1000, 50, "cosine")

    return train_for(OurPotential(m), records, budget, opt=opt, sched_fn=sched, batch_atoms=128,
                     force_weight=force_weight)


def run_variant(name: str, budget: float, probe_budget: float, lrs: list[float],
                force_weights: list[float]) -> dict:
    """(lr, force weight) picked on held-out *training* molecules, then trained on all of
    the training set and evaluated once on the test set."""
    recs = dft_dataset()
    tr, te = molecule_split(recs, 0.4, seed=1)
    train, test = [recs[i] for i in tr], [recs[i] for i in te]
    v_tr, v_val = molecule_split(train, 0.25, seed=2)
    sub, val = [train[i] for i in v_tr], [train[i] for i in v_val]
    if name == "pretrained_refit_only":  # zero-shot: network as pretrained, new references
        m_val, _, _ = make_variant(name, sub, 0.0)
        m, _, _ = make_variant(name, train, 0.0)
        return {"val": evaluate(OurPotential(m_val), val), "test": evaluate(OurPotential(m), test)}
    probe = {}
    for lr in lrs:
        for fw in force_weights:
            m, opt, _ = make_variant(name, sub, lr)
            fit(m, opt, sub, probe_budget, fw)
            probe[f"lr={lr:g},fw={fw:g}"] = (lr, fw, evaluate(OurPotential(m), val)["energy_mae"])
            print(name, "probe", lr, fw, probe[f"lr={lr:g},fw={fw:g}"][2], flush=True)
    lr, fw, _ = min(probe.values(), key=lambda t: t[2])
    m, opt, fc = make_variant(name, train, lr)
    tinfo = fit(m, opt, train, budget, fw)
    return {"lr": lr, "force_weight": fw, "val_energy_mae": {k: v[2] for k, v in probe.items()},
            "train": tinfo, "test": evaluate(OurPotential(m), test),
            "finetune": fc.model_dump() if fc else None,
            "trainable_parameters": sum(p.numel() for p in m.parameters() if p.requires_grad)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=90.0, help="CPU seconds per variant")
    ap.add_argument("--probe-budget", type=float, default=30.0, help="CPU seconds per grid point")
    ap.add_argument("--lr-grid", type=float, nargs="+", default=[5e-5, 3e-4])
    ap.add_argument("--fw-grid", type=float, nargs="+", default=[1.0, 10.0], help="force weights")
    ap.add_argument("--scratch-lr-grid", type=float, nargs="+", default=[1e-3, 3e-3])
    ap.add_argument("--variants",
                    default="pretrained_refit_only,scratch,finetune_embedding,finetune_none,finetune_backbone")
    ap.add_argument("--one")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.one:
        lrs = args.scratch_lr_grid if args.one == "scratch" else args.lr_grid
        res = run_variant(args.one, args.budget, args.probe_budget, lrs, args.fw_grid)
        (DATA / f"transfer_{args.one}.json").write_text(json.dumps(res))
        return
    if not (DATA / "xtb_pretrained").exists():
        sys.exit("run bench/model_accuracy.py --dataset g2 first (it writes bench/data/xtb_pretrained)")
    recs = dft_dataset()
    tr, te = molecule_split(recs, 0.4, seed=1)
    train, test = [recs[i] for i in tr], [recs[i] for i in te]
    print(f"DFT: {len(train)} train / {len(test)} test structures", flush=True)
    import subprocess

    names = args.variants.split(",")
    base = [sys.executable, __file__, "--budget", str(args.budget), "--probe-budget", str(args.probe_budget),
            "--lr-grid", *map(str, args.lr_grid), "--fw-grid", *map(str, args.fw_grid),
            "--scratch-lr-grid", *map(str, args.scratch_lr_grid)]
    procs = {n: subprocess.Popen([*base, "--one", n]) for n in names}
    for n, p in procs.items():
        if p.wait() != 0:
            sys.exit(f"{n} failed")
    results = {n: json.loads((DATA / f"transfer_{n}.json").read_text()) for n in names}
    for n, r in results.items():
        print(n, json.dumps(r["test"]), flush=True)

    s = results.get("scratch", {}).get("test")
    summary: dict = {k: {"energy_mae": v["test"]["energy_mae"], "force_mae": v["test"]["force_mae"]}
                     for k, v in results.items()}
    if s:
        best_ft = min((k for k in results if k.startswith("finetune")),
                      key=lambda k: results[k]["test"]["energy_mae"], default=None)
        if best_ft:
            summary["best_finetune"] = best_ft
            summary["energy_mae_ratio_best_finetune_to_scratch"] = results[best_ft]["test"]["energy_mae"] / s["energy_mae"]
            summary["force_mae_ratio_best_finetune_to_scratch"] = results[best_ft]["test"]["force_mae"] / s["force_mae"]
            if "pretrained_refit_only" in results:
                r0 = results["pretrained_refit_only"]["test"]
                summary["energy_mae_ratio_best_finetune_to_refit_only"] = results[best_ft]["test"]["energy_mae"] / r0["energy_mae"]
                summary["force_mae_ratio_best_finetune_to_refit_only"] = results[best_ft]["test"]["force_mae"] / r0["force_mae"]
    path = write_result("transfer", {
        "data": {"dft": "PySCF B3LYP/6-31G*, rattled G2 molecules <= 7 atoms (no F), 3 conformers",
                 "train_structures": len(train), "test_structures": len(test),
                 "split": "molecule-wise, 40% of molecules held out, seed 1",
                 "dft_train_molecules": sorted({r['molecule_id'] for r in train}),
                 "dft_test_molecules": sorted({r['molecule_id'] for r in test})},
        "pretrained": str(DATA / "xtb_pretrained"), "budget_cpu_seconds_per_variant": args.budget,
        "protocol": {
            "selection": "per variant, (lr, force weight) from the grids by energy MAE on 25% of the DFT "
                         "*training* molecules (models trained on the other 75%, probe budget each); then "
                         "retrained on the whole DFT training set and evaluated once on the test set",
            "scratch": "Adam, fresh model, element references fitted on the training labels",
            "finetune": f"AdamW (backbone LR x{BACKBONE_LR_MULT}), element references refitted on the "
                        "training labels first, then the freeze option",
            "schedule": "5% linear warm-up + cosine over the CPU-time budget", "batch_atoms": 128,
            "lr_grid_finetune": args.lr_grid, "lr_grid_scratch": args.scratch_lr_grid,
            "force_weight_grid": args.fw_grid, "probe_budget_cpu_seconds": args.probe_budget,
            "parallel": "variants run in parallel processes (budgets are per-process CPU time)"},
        "results": results, "summary": summary,
    })
    print(json.dumps(summary, indent=2))
    print("wrote", path)


if __name__ == "__main__":
    main()
