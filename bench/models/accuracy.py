"""Accuracy at equal training budget: our Transformer vs SchNet, PaiNN (schnetpack) and MACE.

Data (``--dataset``): GFN2-xTB energies/forces (tblite). ``nci`` (default): the NCI
compounds shipped with RDKit that are neutral, H/C/N/O/F and <= 20 atoms, 8 structures
each (ETKDGv3 + MMFF94 embeddings with their own seeds, so torsions differ, then
rattled). ``nci2k`` (bench/models/nci2k.py): 2,324 NCI compounds (H/C/N/O/F/S/Cl, <= 30 atoms),
3 ETKDGv3+MMFF94 conformers each plus 3 xTB-MD frames (300 K) per conformer, built by
resumable simulation campaigns on Dask (``--data-chunks N``: only the first N chunks of
100 compounds), split by Bemis-Murcko scaffold so no test scaffold is in training.
``g2``: 62 rattled G2 molecules, 25 each (too few compounds for a headline;
it also writes bench/data/xtb_pretrained for bench/models/transfer.py).

Sides are the models (``--models``; default ours, schnet, painn, and mace when mace-torch
imports, else the JSON says why it was left out; ``ours_softmax``, ``ours_vectors`` and
``ours_bf16`` are optional variants of ours). MACE is mace-torch's own ``ScaleShiftMACE``
(``model.kind: mace``; ``--mace-dtype float64`` for the precision MACE recommends,
``--mace-channels`` for its width), SchNet and PaiNN schnetpack's (``model.kind: schnet |
painn``), every side trained by the one training loop (train/fit.py) for the same
thread-CPU budget. Rounds are folds of a
molecule-wise ``--folds``-fold cross-validation (molecules shuffled with seed 0): round r
trains every side on fold r's training molecules and tests it on fold r's held-out
molecules, sides interleaved (ours, schnet, painn, ours, schnet, painn, ...), all in
this one process on one thread. Medians over folds with min/max/IQR are reported.

One protocol for every model and every budget (the same rule, stated in the JSON): the
same CPU-time budget of single-threaded training (thread CPU time, fair on a shared
CPU; wall time recorded too), the same element reference energies and scale fitted on
the fold's training set, the same loss (per-atom energy MSE + ``--force-weight`` x force
MSE), Adam at the **same learning rate** ``--lr`` with cosine decay over the budget
(optional warm-up), the same EMA of the weights, the same 256-atom batches in the same
seeded order. There is no per-model or per-budget LR probe any more: a probe of a few
CPU seconds picked PaiNN's LR differently at different budgets (0.01 at 300 s, 0.003 at
100 s and 1000 s), so budget curves compared different protocols.

Writes bench/results/model_accuracy.json (or ``--out``). Usage:
    .venv/bin/python -m bench.models.accuracy [--budget 15] [--rounds 3] [--folds 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.lib.harness import Side, add_args, check_clean, interleave, write_result
from bench.models.molbench import DATA, evaluate
from bench.models.molbench_sides import (
    PEERS,
    Folds,
    add_training_args,
    autocast_of,
    check_data_args,
    common_settings,
    differences,
    fail,
    resolve_sides,
    side_settings,
    train_side,
)


def side_runner(name: str, args: argparse.Namespace, folds: Folds):  # noqa: ANN201
    """The callable of one side: round r = fold r; returns that fold's test metrics."""
    autocast = autocast_of(name)

    def run(r: int) -> dict[str, Any]:
        from convergent.models.io import save_model

        fold = r
        train, test, _ = folds.get(fold)
        pot, n_params, cfg, tinfo = train_side(name, args, train, args.seed)
        test_m = evaluate(pot, test, autocast=autocast)
        row: dict[str, Any] = {k: test_m[k] for k in (
            "energy_mae", "energy_mae_per_atom", "energy_mae_molecule_offset",
            "energy_mae_within_molecule", "force_mae", "seconds_per_structure")}
        row.update(fold=fold, n_train=len(train), n_test=len(test), parameters=n_params,
                   train_steps=tinfo["steps"], train_cpu_seconds=tinfo["cpu_seconds"],
                   train_wall_seconds=tinfo["wall_seconds"],
                   train_steps_per_cpu_second=tinfo["steps_per_cpu_second"],
                   diverged_at_step=tinfo["diverged_at_step"])
        if name == "mace":  # the per-fold values fixed from the data when MACE is built
            row.update(mace_avg_num_neighbors=float(pot.model.avg_num_neighbors),
                       mace_atomic_inter_scale=float(pot.model.scale))
        if autocast is not None:
            row["energy_mae_eval_fp32"] = evaluate(pot, test)["energy_mae"]
        if name == "ours" and fold == 0 and args.dataset == "g2" and args.save_pretrained:
            save_model(pot.model, cfg, DATA / "xtb_pretrained",
                       extra={"trained_on": f"xtb_g2_25_0 fold 0 of {args.folds} (molecule-wise) "
                                            f"train split, {args.budget} CPU s", "test": test_m})
        return row

    return run


def md_summary(path: str) -> dict[str, Any]:
    """The MD-stability numbers of a bench/models/md_stability.py result (exit 2 if unreadable)."""
    import json

    try:
        d = json.loads(Path(path).read_text())
        return {"md_stable_fraction": d["md_stable_fraction"], "source": path,
                "commit": d["commit"], "dirty": d.get("dirty"),
                "nve_abs_drift_eV_per_atom_per_ps": d.get("nve_abs_drift_eV_per_atom_per_ps"),
                "md": next(iter(d["settings"].values()), {}).get("md"),
                "budget_thread_cpu_s": next(iter(d["settings"].values()), {}).get("budget_thread_cpu_s")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        fail(f"--md-result {path}: not a bench/models/md_stability.py result ({type(exc).__name__}: {exc})")
        raise  # unreachable: fail exits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(ap, default_out="bench/results/model_accuracy.json", rounds=3)
    add_training_args(ap)
    ap.add_argument("--no-save-pretrained", dest="save_pretrained", action="store_false")
    ap.add_argument("--md-result", default=None,
                    help="a bench/models/md_stability.py JSON whose md_stable_fraction (with its "
                         "commit and settings) is carried into this result's top level")
    args = ap.parse_args()
    md = md_summary(args.md_result) if args.md_result else None
    if not 1 <= args.rounds <= args.folds:
        fail(f"--rounds {args.rounds} must be between 1 and --folds {args.folds}")
    check_data_args(args)
    names, skipped, mace_version = resolve_sides(args.models)
    check_clean(args)
    torch.set_num_threads(1)
    folds = Folds(args)
    common, settings = common_settings(args), side_settings(args, mace_version)
    sides = [Side(n, side_runner(n, args, folds), {**common, **settings.get(n, {"model": n})})
             for n in names]
    res = interleave("model_accuracy", sides, rounds=args.rounds, differences=differences(args, names))
    res.extra["data"] = folds.describe(f"round r = fold r, folds 0..{args.rounds - 1} run")
    if skipped:
        res.extra["skipped_sides"] = skipped
    res.extra["command"] = " ".join(["python", "-m", "bench.models.accuracy", *sys.argv[1:]])
    if "ours" in names:
        peers = [p for p in PEERS if p in names]
        for p in peers:
            ratios = [a["energy_mae"] / b["energy_mae"]
                      for a, b in zip(res.per_round["ours"], res.per_round[p], strict=True)]
            res.headline[f"energy_mae_ratio_ours_to_{p}_median"] = float(np.median(ratios))
            res.headline[f"energy_mae_ratio_ours_to_{p}_per_fold"] = ratios
        res.headline["energy_mae_median_eV"] = {n: res.median(n, "energy_mae") for n in names}
        res.headline["force_mae_median_eV_per_A"] = {n: res.median(n, "force_mae") for n in names}
    if md is not None:
        res.headline["md_stable_fraction"] = md.pop("md_stable_fraction")
        res.extra["md_stability"] = md
    write_result(res, args)


if __name__ == "__main__":
    main()
