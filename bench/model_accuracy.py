"""Accuracy at equal training budget: our Transformer vs SchNet, PaiNN (schnetpack) and MACE.

Data (``--dataset``): GFN2-xTB energies/forces (tblite). ``nci`` (default): the NCI
compounds shipped with RDKit that are neutral, H/C/N/O/F and <= 20 atoms, 8 structures
each (ETKDGv3 + MMFF94 embeddings with their own seeds, so torsions differ, then
rattled). ``g2``: 62 rattled G2 molecules, 25 each (too few compounds for a headline;
it also writes bench/data/xtb_pretrained for bench/transfer.py).

Sides are the models (``--models``; default ours, schnet, painn, and mace when mace-torch
imports, else the JSON says why it was left out; ``ours_softmax``, ``ours_vectors`` and
``ours_bf16`` are optional variants of ours). MACE is mace-torch's own ``ScaleShiftMACE``
(bench/molbench_mace.py; ``--mace-dtype float64`` for the precision MACE recommends,
``--mace-hidden-irreps`` for its width) trained by the same loop as the others. Rounds are folds of a
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
    .venv/bin/python bench/model_accuracy.py [--budget 15] [--rounds 3] [--folds 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _harness import Side, add_args, check_clean, interleave, write_result  # noqa: E402
from molbench import (  # noqa: E402
    DATA,
    OurPotential,
    SpkPotential,
    evaluate,
    molecule_folds,
    train_for,
    xtb_dataset,
    xtb_nci_dataset,
)
from molbench_mace import MACE_DEFAULTS, MacePotential, mace_available  # noqa: E402

PEERS = ("schnet", "painn", "mace")
SPK_PEERS = ("schnet", "painn")
SIDES = ("ours", "ours_softmax", "ours_vectors", "ours_bf16", *PEERS)
BATCH_ATOMS = 256
DATASETS = {
    "nci": (xtb_nci_dataset, "GFN2-xTB (tblite) on the NCI compounds shipped with RDKit: neutral, "
                             "H/C/N/O/F, <= 20 atoms, 8 structures each (ETKDGv3 + MMFF94, rattled)"),
    "g2": (xtb_dataset, "GFN2-xTB (tblite) on rattled G2 molecules (closed shell, H/C/N/O/F, "
                        "<= 12 atoms, 25 each)"),
}


def build(name: str, args: argparse.Namespace, ref: Any, seed: int,
          train: list[dict[str, Any]]) -> tuple[Any, int, Any]:
    """A fresh potential for side ``name`` (initialised with ``seed``; MACE takes its
    average neighbour count from the ``train`` records)."""
    from convergent.models.config import ModelConfig
    from convergent.models.molecular import build_model, count_parameters

    torch.manual_seed(seed)
    if name.startswith("ours"):
        weights = "softmax" if "softmax" in name else None  # else the model default (silu)
        cfg = ModelConfig(hidden=args.hidden, layers=args.layers, heads=4, cutoff=args.cutoff,
                          vectors="vectors" in name,
                          **({"attention_weights": weights} if weights else {}))
        model = build_model(cfg)
        model.set_reference(ref)
        return OurPotential(model), count_parameters(model), cfg
    if name == "mace":
        pot = MacePotential(args.cutoff, ref, train, dtype=getattr(torch, args.mace_dtype),
                            hidden_irreps=args.mace_hidden_irreps)
        return pot, sum(p.numel() for p in pot.parameters()), pot.settings
    pot = SpkPotential(name, args.hidden, args.layers, args.cutoff, ref)
    return pot, sum(p.numel() for p in pot.parameters()), None


def schedule(warmup: float):  # noqa: ANN201
    """LR factor vs budget fraction: linear warm-up over ``warmup``, then cosine to 0."""

    def f(x: float) -> float:
        w = min(1.0, x / warmup) if warmup > 0 else 1.0
        return w * 0.5 * (1 + math.cos(math.pi * min(1.0, x)))

    return f


class Folds:
    """The dataset, split once per fold (cached: every side of a round shares it)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.records = DATASETS[args.dataset][0]()
        self._cache: dict[int, tuple[list, list, Any]] = {}

    def get(self, fold: int) -> tuple[list, list, Any]:
        from convergent.models.molecular import fit_reference_energies

        if fold not in self._cache:
            self._cache.clear()
            tr, te = molecule_folds(self.records, self.args.folds, fold, seed=0)
            train, test = [self.records[i] for i in tr], [self.records[i] for i in te]
            self._cache[fold] = (train, test, fit_reference_energies(train))
        return self._cache[fold]


def side_runner(name: str, args: argparse.Namespace, folds: Folds):  # noqa: ANN201
    """The callable of one side: round r = fold r; returns that fold's test metrics."""
    autocast = torch.bfloat16 if name.endswith("bf16") else None

    def run(r: int) -> dict[str, Any]:
        from convergent.models.io import save_model

        fold = r
        train, test, ref = folds.get(fold)
        seed = args.seed
        pot, n_params, cfg = build(name, args, ref, seed, train)
        tinfo = train_for(pot, train, args.budget, lr=args.lr, batch_atoms=BATCH_ATOMS,
                          force_weight=args.force_weight, seed=seed, autocast=autocast,
                          sched_fn=schedule(args.warmup), ema_decay=args.ema)
        test_m = evaluate(pot, test, autocast=autocast)
        row: dict[str, Any] = {k: test_m[k] for k in (
            "energy_mae", "energy_mae_per_atom", "energy_mae_molecule_offset",
            "energy_mae_within_molecule", "force_mae", "seconds_per_structure")}
        row.update(fold=fold, n_train=len(train), n_test=len(test), parameters=n_params,
                   train_steps=tinfo["steps"], train_cpu_seconds=tinfo["cpu_seconds"],
                   train_wall_seconds=tinfo["wall_seconds"],
                   train_structures_per_cpu_second=tinfo["structures_per_cpu_second"],
                   diverged_at_step=tinfo["diverged_at_step"])
        if name == "mace":  # the per-fold values of its settings (the rest are in settings)
            row.update(mace_avg_num_neighbors=cfg["avg_num_neighbors"],
                       mace_atomic_inter_scale=cfg["atomic_inter_scale"])
        if autocast is not None:
            row["energy_mae_eval_fp32"] = evaluate(pot, test)["energy_mae"]
        if name == "ours" and fold == 0 and args.dataset == "g2" and args.save_pretrained:
            save_model(pot.model, cfg, DATA / "xtb_pretrained",
                       extra={"trained_on": f"xtb_g2_25_0 fold 0 of {args.folds} (molecule-wise) "
                                            f"train split, {args.budget} CPU s", "test": test_m})
        return row

    return run


def fail(msg: str) -> None:
    """Bad input: one line on stderr, exit code 2, before any work."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(ap, default_out="bench/results/model_accuracy.json", rounds=3)
    ap.add_argument("--dataset", default="nci", choices=sorted(DATASETS))
    ap.add_argument("--budget", type=float, default=15.0,
                    help="thread-CPU seconds of training per model and fold")
    ap.add_argument("--folds", type=int, default=5, help="molecule-wise CV folds (rounds <= folds)")
    ap.add_argument("--lr", type=float, default=3e-3,
                    help="Adam LR of every model at every budget (3e-3: what the old per-model "
                         "probes picked for ours, schnet and painn at most budgets)")
    ap.add_argument("--seed", type=int, default=0, help="init and batch-order seed (every side)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--cutoff", type=float, default=5.0)
    ap.add_argument("--force-weight", type=float, default=0.01,
                    help="loss = per-atom energy MSE + this x force MSE")
    ap.add_argument("--ema", type=float, default=0.99, help="EMA decay of the weights (0 = off)")
    ap.add_argument("--warmup", type=float, default=0.0, help="LR warm-up, fraction of the budget")
    ap.add_argument("--models", default=None,
                    help="sides: ours, schnet, painn, mace, ours_softmax, ours_vectors, ours_bf16 "
                         "(default ours,schnet,painn plus mace when mace-torch imports)")
    ap.add_argument("--mace-dtype", default="float32", choices=("float32", "float64"),
                    help="MACE's dtype (it recommends float64 for MD and accuracy; float32 "
                         "is the others' precision and about twice as fast on this CPU)")
    ap.add_argument("--mace-hidden-irreps", default=MACE_DEFAULTS["hidden_irreps"],
                    help="MACE's hidden irreps (its own default 128x0e+128x1o is large for a "
                         "CPU budget)")
    ap.add_argument("--no-save-pretrained", dest="save_pretrained", action="store_false")
    args = ap.parse_args()
    if not 1 <= args.rounds <= args.folds:
        fail(f"--rounds {args.rounds} must be between 1 and --folds {args.folds}")
    mace_ok, mace_info = mace_available()
    skipped: dict[str, str] = {}
    if args.models is None:
        names = ["ours", "schnet", "painn"]
        if mace_ok:
            names.append("mace")
        else:
            skipped["mace"] = f"{mace_info}; run: .venv/bin/pip install -e '.[mace]'"
    else:
        names = args.models.split(",")
        unknown = [n for n in names if n not in SIDES]
        if unknown:
            fail(f"--models: unknown side(s) {', '.join(unknown)}; known: {', '.join(SIDES)}")
    if "mace" in names and not mace_ok:
        fail(f"--models names mace but {mace_info}; run: .venv/bin/pip install -e '.[mace]'")
    if set(SPK_PEERS) & set(names) and importlib.util.find_spec("schnetpack") is None:
        fail("--models names a schnetpack peer but schnetpack is not installed; "
                 "run: .venv/bin/pip install -e '.[bench]'")
    check_clean(args)
    torch.set_num_threads(1)
    folds = Folds(args)
    common = {"dataset": args.dataset, "folds": args.folds, "budget_thread_cpu_s": args.budget,
              "lr": args.lr, "lr_rule": "one fixed LR for every model and every budget (no probe)",
              "optimizer": "Adam, cosine decay over the budget", "warmup_fraction": args.warmup,
              "ema_decay": args.ema, "force_weight": args.force_weight,
              "batch_atoms": BATCH_ATOMS, "batch_order_seed": args.seed, "init_seed": args.seed,
              "torch_threads": 1, "hidden": args.hidden, "layers": args.layers,
              "cutoff_A": args.cutoff, "grad_clip_norm": 10.0,
              "references": "element reference energies + scale fitted on the fold's training set",
              "trainer": "bench/molbench.py:train_for"}
    settings = {
        "ours": {"model": "convergent MolecularTransformer (silu-gated attention)"},
        "ours_softmax": {"model": "convergent MolecularTransformer, softmax attention weights"},
        "ours_vectors": {"model": "convergent MolecularTransformer with the vector channel"},
        "ours_bf16": {"model": "convergent MolecularTransformer", "autocast": "bf16 (CPU)"},
        "schnet": {"model": "schnetpack SchNet + Atomwise", "n_rbf": 20, "cutoff_fn": "cosine"},
        "painn": {"model": "schnetpack PaiNN + Atomwise", "n_rbf": 20, "cutoff_fn": "cosine"},
        "mace": {"model": f"mace-torch {mace_info if mace_ok else '(absent)'} ScaleShiftMACE, "
                          "trained by bench/molbench.py:train_for (not mace_run_train)",
                 **MACE_DEFAULTS, "hidden_irreps": args.mace_hidden_irreps,
                 "r_max": args.cutoff, "dtype": args.mace_dtype,
                 "forces": "-dE/dx by autograd (MACE's own output)",
                 "inputs": "MACE's input dict built from our batches, neighbours from "
                           "convergent.models.atoms.neighbor_list (not mace.data.AtomicData)",
                 "ignored_common": "hidden, layers (MACE's width and depth are hidden_irreps "
                                   "and num_interactions)"},
    }
    sides = [Side(n, side_runner(n, args, folds), {**common, **settings.get(n, {"model": n})})
             for n in names]
    differences = [
        "architectures differ (that is the comparison): parameter counts are in per_round",
        "equal thread-CPU time, not equal steps: a model that is cheaper per step sees more "
        "batches (train_steps, train_structures_per_cpu_second per round)",
        "schnetpack peers use their own radial basis (20 Gaussians, cosine cutoff); ours its "
        "own; both get neighbours from convergent.models.atoms.neighbor_list",
        f"the budget ({args.budget} thread-CPU s) is small for this 2-core shared machine: "
        "every model is under-trained; compare models within this run, not with other budgets",
    ]
    if "mace" in names:
        differences.append(
            f"mace is MACE's own model (ScaleShiftMACE, {args.mace_hidden_irreps}, "
            f"{MACE_DEFAULTS['num_interactions']} interactions, max_ell {MACE_DEFAULTS['max_ell']}, "
            f"correlation {MACE_DEFAULTS['correlation']}, {MACE_DEFAULTS['num_bessel']} Bessel + "
            f"polynomial cutoff p={MACE_DEFAULTS['num_polynomial_cutoff']}) in {args.mace_dtype}, "
            "but trained by our loop under this protocol: not MACE's own recipe (mace_run_train's "
            "weighted energy/force loss, AMSGrad at lr 0.01, SWA/stage two, float64)")
    if "ours_bf16" in names:
        differences.append("ours_bf16 trains and evaluates under bf16 autocast (the others fp32)")
    res = interleave("model_accuracy", sides, rounds=args.rounds, differences=differences)
    recs = folds.records
    res.extra["data"] = {"dataset": args.dataset, "source": DATASETS[args.dataset][1],
                         "structures": len(recs),
                         "molecules": len({r["molecule_id"] for r in recs}),
                         "split": f"molecule-wise {args.folds}-fold CV (molecules shuffled, seed 0); "
                                  f"round r = fold r, folds 0..{args.rounds - 1} run"}
    if skipped:
        res.extra["skipped_sides"] = skipped
    res.extra["command"] = " ".join(["python", "bench/model_accuracy.py", *sys.argv[1:]])
    if "ours" in names:
        peers = [p for p in PEERS if p in names]
        for p in peers:
            ratios = [a["energy_mae"] / b["energy_mae"]
                      for a, b in zip(res.per_round["ours"], res.per_round[p], strict=True)]
            res.headline[f"energy_mae_ratio_ours_to_{p}_median"] = float(np.median(ratios))
            res.headline[f"energy_mae_ratio_ours_to_{p}_per_fold"] = ratios
        res.headline["energy_mae_median_eV"] = {n: res.median(n, "energy_mae") for n in names}
        res.headline["force_mae_median_eV_per_A"] = {n: res.median(n, "force_mae") for n in names}
    write_result(res, args)


if __name__ == "__main__":
    main()
