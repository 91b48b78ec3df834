"""Transfer learning: fine-tune an xTB-pretrained surrogate on a small DFT set vs
training from scratch on the same small set; MAE on a held-out DFT test set.

DFT: PySCF B3LYP/6-31G* energies/forces of rattled small G2 molecules (<= 7 atoms, 3
conformers each, no fluorine), split molecule-wise (60 % of the molecules for the small
training set, 40 % held out, seed 1). Pretrained model: made by this run before the
sides start (``--pretrain-budget`` thread-CPU s of bench/model_accuracy.py's recipe on
the GFN2-xTB labels of the training molecules of fold 0 of its 5-fold G2 split; cheap
labels cover many molecules, including some whose DFT labels are held out here: that is
the intended use of the cheap tier), so the result never depends on a model file left
by an earlier run.

Sides: ``pretrained_refit_only`` (zero-shot: pretrained network, element references
refitted on the DFT training labels: the baseline a fine-tune must beat),
``scratch`` (fresh model, Adam), ``finetune_embedding`` / ``finetune_none`` /
``finetune_backbone`` (convergent.models.transfer: references refitted first, then
that freeze option, AdamW with the backbone LR x0.3). Rounds are seeds (init of the
scratch model and the batch order of every side), sides interleaved. Every trained side
gets the same thread-CPU budget, the same 128-atom batches in the same seeded order and
the same schedule (5 % linear warm-up + cosine). Medians over seeds with min/max/IQR.

Writes bench/results/transfer.json. Usage:
    .venv/bin/python bench/transfer.py [--rounds 3] [--budget 10] [--pretrain-budget 40]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _harness import Side, add_args, check_clean, interleave, write_result  # noqa: E402
from molbench import (  # noqa: E402
    OurPotential,
    dft_dataset,
    evaluate,
    molecule_folds,
    molecule_split,
    train_for,
    xtb_dataset,
)

BACKBONE_LR_MULT = 0.3
BATCH_ATOMS = 128
VARIANTS = ("pretrained_refit_only", "scratch", "finetune_embedding", "finetune_none",
            "finetune_backbone")


def pretrain(budget: float) -> tuple[dict[str, torch.Tensor], Any, dict[str, Any]]:
    """Our model trained on GFN2-xTB G2 fold 0 (model_accuracy's default recipe)."""
    import math

    from convergent.models.config import ModelConfig
    from convergent.models.molecular import build_model, fit_reference_energies

    recs = xtb_dataset()
    tr, te = molecule_folds(recs, 5, 0, seed=0)
    train, test = [recs[i] for i in tr], [recs[i] for i in te]
    torch.manual_seed(0)
    cfg = ModelConfig(hidden=64, layers=3, heads=4, cutoff=5.0)
    model = build_model(cfg)
    model.set_reference(fit_reference_energies(train))
    info = train_for(OurPotential(model), train, budget, lr=3e-3, batch_atoms=256,
                     force_weight=0.01, seed=0, ema_decay=0.99,
                     sched_fn=lambda x: 0.5 * (1 + math.cos(math.pi * min(1.0, x))))
    meta = {"data": "GFN2-xTB G2 (xtb_g2_25_0), molecule-wise 5-fold split seed 0, fold 0 train",
            "budget_thread_cpu_s": budget, "lr": 3e-3, "force_weight": 0.01, "ema_decay": 0.99,
            "batch_atoms": 256, "model": cfg.model_dump(), "train_steps": info["steps"],
            "xtb_test_fold0": evaluate(OurPotential(model), test)}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, cfg, meta


def make_variant(name: str, train: list, state: dict, cfg: Any, hp: dict, seed: int):  # noqa: ANN201
    """A fresh model and optimiser for ``name`` with references fitted on ``train``."""
    from convergent.models.molecular import build_model, fit_reference_energies
    from convergent.models.transfer import FinetuneConfig, freeze, param_groups

    torch.manual_seed(seed)
    m = build_model(cfg)
    ref = fit_reference_energies(train)
    if name == "scratch":
        m.set_reference(ref)
        return m, torch.optim.Adam(m.parameters(), lr=hp["lr"])
    m.load_state_dict(state)
    ref.scale, ref.shift = float(m.scale), float(m.shift)  # pretrained scale kept
    m.set_reference(ref)
    if name == "pretrained_refit_only":
        return m, None
    fc = FinetuneConfig(freeze=name.split("_", 1)[1], lr=hp["lr"], backbone_lr_mult=BACKBONE_LR_MULT)
    freeze(m, fc.freeze)
    return m, torch.optim.AdamW(param_groups(m, fc.lr, fc.backbone_lr_mult), weight_decay=0.0)


def side_runner(name: str, data: tuple[list, list], pre: tuple, hp: dict, budget: float):  # noqa: ANN201
    from convergent.models.transfer import lr_factor

    train, test = data

    def sched(frac: float) -> float:  # 5 % linear warm-up, then cosine to 0
        return lr_factor(int(frac * 1000), 1000, 50, "cosine")

    def run(seed: int) -> dict[str, Any]:
        m, opt = make_variant(name, train, pre[0], pre[1], hp, seed)
        row: dict[str, Any] = {"seed": seed}
        if opt is not None:
            t = train_for(OurPotential(m), train, budget, opt=opt, sched_fn=sched,
                          batch_atoms=BATCH_ATOMS, force_weight=hp["force_weight"], seed=seed)
            row.update(train_steps=t["steps"], train_cpu_seconds=t["cpu_seconds"],
                       diverged_at_step=t["diverged_at_step"])
        ev = evaluate(OurPotential(m), test)
        row.update(energy_mae=ev["energy_mae"], force_mae=ev["force_mae"],
                   energy_mae_per_atom=ev["energy_mae_per_atom"],
                   trainable_parameters=sum(p.numel() for p in m.parameters() if p.requires_grad))
        return row

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(ap, default_out="bench/results/transfer.json", rounds=3)
    ap.add_argument("--budget", type=float, default=10.0, help="thread-CPU seconds per trained side")
    ap.add_argument("--pretrain-budget", type=float, default=40.0,
                    help="thread-CPU seconds of xTB pretraining (once per run, before the sides)")
    ap.add_argument("--scratch-lr", type=float, default=3e-3)
    ap.add_argument("--scratch-force-weight", type=float, default=1.0)
    ap.add_argument("--finetune-lr", type=float, default=5e-5)
    ap.add_argument("--finetune-force-weight", type=float, default=10.0)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    check_clean(args)
    torch.set_num_threads(1)
    recs = dft_dataset(workers=2)
    tr, te = molecule_split(recs, 0.4, seed=1)
    train, test = [recs[i] for i in tr], [recs[i] for i in te]
    print(f"DFT: {len(train)} train / {len(test)} test structures; pretraining", flush=True)
    state, cfg, pre_meta = pretrain(args.pretrain_budget)
    names = args.variants.split(",")
    hps = {n: ({"lr": args.scratch_lr, "force_weight": args.scratch_force_weight} if n == "scratch"
               else {"lr": args.finetune_lr, "force_weight": args.finetune_force_weight})
           for n in names}
    common = {"budget_thread_cpu_s": args.budget, "batch_atoms": BATCH_ATOMS,
              "schedule": "5% linear warm-up + cosine over the budget", "torch_threads": 1,
              "grad_clip_norm": 10.0, "seed": "round number (init of scratch, batch order)"}
    settings = {
        "pretrained_refit_only": {"training": "none: element references refitted on the DFT "
                                              "training labels, pretrained network and scale"},
        "scratch": {**common, **hps.get("scratch", {}), "optimizer": "Adam",
                    "references": "fitted on the DFT training labels"},
    }
    for n in names:
        if n.startswith("finetune"):
            settings[n] = {**common, **hps[n], "optimizer": "AdamW, weight decay 0",
                           "freeze": n.split("_", 1)[1], "backbone_lr_mult": BACKBONE_LR_MULT,
                           "references": "refitted on the DFT training labels, pretrained scale"}
    pre = (state, cfg)
    sides = [Side(n, side_runner(n, (train, test), pre, hps[n], args.budget), settings[n])
             for n in names]
    differences = [
        f"scratch trains at LR {args.scratch_lr} / force weight {args.scratch_force_weight}, the "
        f"fine-tunes at LR {args.finetune_lr} / force weight {args.finetune_force_weight}: a fresh "
        "network and a pretrained one need different step sizes; these are the values the "
        "earlier per-variant validation probe (on DFT training molecules only) picked, fixed "
        "here so every seed and budget uses one rule",
        "scratch uses Adam, the fine-tunes AdamW (weight decay 0, i.e. the same update) with "
        f"backbone parameters at x{BACKBONE_LR_MULT} the LR",
        "pretrained_refit_only does no training (zero-shot baseline): its value is the same "
        "every seed",
        f"the budget ({args.budget} thread-CPU s) is small for this shared 2-core machine",
    ]
    res = interleave("transfer", sides, rounds=args.rounds, differences=differences)
    res.extra["pretrained"] = pre_meta
    res.extra["data"] = {"dft": "PySCF B3LYP/6-31G*, rattled G2 molecules <= 7 atoms (no F), "
                                "3 conformers", "train_structures": len(train),
                         "test_structures": len(test),
                         "split": "molecule-wise, 40% of molecules held out, seed 1",
                         "dft_train_molecules": sorted({r["molecule_id"] for r in train}),
                         "dft_test_molecules": sorted({r["molecule_id"] for r in test})}
    res.extra["command"] = " ".join(["python", "bench/transfer.py", *sys.argv[1:]])
    res.headline["energy_mae_median_eV"] = {n: res.median(n, "energy_mae") for n in names}
    res.headline["force_mae_median_eV_per_A"] = {n: res.median(n, "force_mae") for n in names}
    fts = [n for n in names if n.startswith("finetune")]
    if fts and "scratch" in names:
        best = min(fts, key=lambda n: res.median(n, "energy_mae"))
        per = [a["energy_mae"] / b["energy_mae"]
               for a, b in zip(res.per_round[best], res.per_round["scratch"], strict=True)]
        res.headline["best_finetune_by_median"] = best
        res.headline["energy_mae_ratio_best_finetune_to_scratch_median"] = float(np.median(per))
        res.headline["energy_mae_ratio_best_finetune_to_scratch_per_seed"] = per
        if "pretrained_refit_only" in names:
            res.headline["energy_mae_ratio_best_finetune_to_refit_only"] = res.ratio(
                best, "pretrained_refit_only", "energy_mae")
    write_result(res, args)


if __name__ == "__main__":
    main()
