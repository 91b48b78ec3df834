"""The sides of the molecular benchmarks and how each is built and trained: one place.

bench/models/accuracy.py (accuracy at equal budget) and bench/models/md_stability.py (MD with the
trained models) train every side the same way: the same datasets (:data:`DATASETS`), the
same molecule-wise folds (:class:`Folds`), the same model settings and training protocol
(:func:`add_training_args`, :func:`check_data_args`, :func:`build`, :func:`train_side`),
the same side names and checks (:func:`resolve_sides`) and the same settings record in the
JSON (:func:`common_settings`, :func:`side_settings`). ``nci2k`` (bench/models/nci2k.py) is split
by Bemis-Murcko scaffold instead, so no test scaffold is in training (asserted per fold).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from typing import Any

import torch

from bench.models.molbench import (
    OurPotential,
    SpkPotential,
    molecule_folds,
    train_for,
    xtb_dataset,
    xtb_nci_dataset,
)
from bench.models.molbench_mace import MACE_DEFAULTS, MacePotential, mace_available
from bench.models.nci2k import Nci2kSettings, group_folds, scaffold_group, split_report
from bench.models.nci2k import load as nci2k_load

PEERS = ("schnet", "painn", "mace")
SPK_PEERS = ("schnet", "painn")
SIDES = ("ours", "ours_softmax", "ours_vectors", "ours_bf16", *PEERS)
BATCH_ATOMS = 256
DATASETS = {
    "nci": (xtb_nci_dataset, "GFN2-xTB (tblite) on the NCI compounds shipped with RDKit: neutral, "
                             "H/C/N/O/F, <= 20 atoms, 8 structures each (ETKDGv3 + MMFF94, rattled)"),
    "nci2k": (nci2k_load, Nci2kSettings().describe() + "; scaffold-split (Bemis-Murcko)"),
    "g2": (xtb_dataset, "GFN2-xTB (tblite) on rattled G2 molecules (closed shell, H/C/N/O/F, "
                        "<= 12 atoms, 25 each)"),
}


def fail(msg: str) -> None:
    """Bad input: one line on stderr, exit code 2, before any work."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def add_training_args(ap: argparse.ArgumentParser) -> None:
    """The flags of the data, the models and the training protocol (shared by the benches)."""
    ap.add_argument("--dataset", default="nci", choices=sorted(DATASETS))
    ap.add_argument("--budget", type=float, default=15.0,
                    help="thread-CPU seconds of training per model and fold")
    ap.add_argument("--folds", type=int, default=5,
                    help="molecule-wise CV folds (nci2k: scaffold-grouped)")
    ap.add_argument("--data-chunks", type=int, default=None,
                    help="nci2k only: use the first N chunks of 100 compounds (default: all; "
                         "missing chunks are built first, resumably)")
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


def check_data_args(args: argparse.Namespace) -> None:
    """The data flags' cross-checks (exit 2 with one line, before any work)."""
    if args.data_chunks is not None and (args.dataset != "nci2k" or args.data_chunks < 1):
        fail(f"--data-chunks {args.data_chunks}: only with --dataset nci2k, and >= 1")


def resolve_sides(models: str | None, allowed: tuple[str, ...] = SIDES) -> tuple[list[str], dict[str, str], str | None]:
    """(side names, sides left out with the reason, MACE's version or None) for ``--models``;
    bad names or a named peer whose package is missing exit 2 (:func:`fail`)."""
    mace_ok, mace_info = mace_available()
    skipped: dict[str, str] = {}
    if models is None:
        names = ["ours", "schnet", "painn"]
        if mace_ok:
            names.append("mace")
        else:
            skipped["mace"] = f"{mace_info}; run: .venv/bin/pip install -e '.[mace]'"
    else:
        names = models.split(",")
        unknown = [n for n in names if n not in allowed]
        if unknown:
            fail(f"--models: unknown side(s) {', '.join(unknown)}; known: {', '.join(allowed)}")
    if "mace" in names and not mace_ok:
        fail(f"--models names mace but {mace_info}; run: .venv/bin/pip install -e '.[mace]'")
    if set(SPK_PEERS) & set(names) and importlib.util.find_spec("schnetpack") is None:
        fail("--models names a schnetpack peer but schnetpack is not installed; "
             "run: .venv/bin/pip install -e '.[bench]'")
    return names, skipped, (mace_info if mace_ok else None)


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
        if args.dataset == "nci2k":  # built (resumably) on first use; --data-chunks: a part
            self.records = nci2k_load(chunks=args.data_chunks)
        else:
            self.records = DATASETS[args.dataset][0]()
        self._cache: dict[int, tuple[list, list, Any]] = {}

    def get(self, fold: int) -> tuple[list, list, Any]:
        from convergent.models.molecular import fit_reference_energies

        if fold not in self._cache:
            self._cache.clear()
            if self.args.dataset == "nci2k":  # test scaffolds are never in training
                tr, te = group_folds(self.records, scaffold_group, self.args.folds, fold, seed=0)
                shared = ({scaffold_group(self.records[i]) for i in tr}
                          & {scaffold_group(self.records[i]) for i in te})
                assert not shared, f"fold {fold}: scaffold groups in train and test: {sorted(shared)[:3]}"
            else:
                tr, te = molecule_folds(self.records, self.args.folds, fold, seed=0)
            train, test = [self.records[i] for i in tr], [self.records[i] for i in te]
            self._cache[fold] = (train, test, fit_reference_energies(train))
        return self._cache[fold]

    def describe(self, rounds_note: str) -> dict[str, Any]:
        recs, n = self.records, self.args.folds
        out = {"dataset": self.args.dataset, "source": DATASETS[self.args.dataset][1],
               "structures": len(recs), "molecules": len({r["molecule_id"] for r in recs}),
               "split": f"molecule-wise {n}-fold CV (molecules shuffled, seed 0); " + rounds_note}
        if self.args.dataset == "nci2k":
            out["split"] = (f"scaffold-grouped {n}-fold CV (Bemis-Murcko groups shuffled with "
                            "seed 0, dealt largest first to the smallest fold); " + rounds_note
                            + "; no test scaffold in training (asserted per fold)")
            out["scaffolds"] = split_report(recs, n, seed=0)
            out["data_chunks"] = self.args.data_chunks or "all"
        return out


def autocast_of(name: str) -> Any:
    return torch.bfloat16 if name.endswith("bf16") else None


def train_side(name: str, args: argparse.Namespace, train: list[dict[str, Any]], ref: Any,
               seed: int) -> tuple[Any, int, Any, dict[str, Any]]:
    """Build side ``name`` with ``seed`` and train it on ``train`` under the shared protocol:
    (potential, parameter count, its config/settings, train_for's record)."""
    pot, n_params, cfg = build(name, args, ref, seed, train)
    tinfo = train_for(pot, train, args.budget, lr=args.lr, batch_atoms=BATCH_ATOMS,
                      force_weight=args.force_weight, seed=seed, autocast=autocast_of(name),
                      sched_fn=schedule(args.warmup), ema_decay=args.ema)
    return pot, n_params, cfg, tinfo


def common_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The protocol every side shares (as written into the JSON)."""
    return {"dataset": args.dataset, "folds": args.folds, "budget_thread_cpu_s": args.budget,
            "lr": args.lr, "lr_rule": "one fixed LR for every model and every budget (no probe)",
            "optimizer": "Adam, cosine decay over the budget", "warmup_fraction": args.warmup,
            "ema_decay": args.ema, "force_weight": args.force_weight,
            "batch_atoms": BATCH_ATOMS, "batch_order_seed": args.seed, "init_seed": args.seed,
            "torch_threads": 1, "hidden": args.hidden, "layers": args.layers,
            "cutoff_A": args.cutoff, "grad_clip_norm": 10.0,
            "references": "element reference energies + scale fitted on the fold's training set",
            "trainer": "bench/models/molbench.py:train_for"}


def side_settings(args: argparse.Namespace, mace_version: str | None) -> dict[str, dict[str, Any]]:
    """Each side's own settings (as written into the JSON)."""
    return {
        "ours": {"model": "convergent MolecularTransformer (silu-gated attention)"},
        "ours_softmax": {"model": "convergent MolecularTransformer, softmax attention weights"},
        "ours_vectors": {"model": "convergent MolecularTransformer with the vector channel"},
        "ours_bf16": {"model": "convergent MolecularTransformer", "autocast": "bf16 (CPU)"},
        "schnet": {"model": "schnetpack SchNet + Atomwise", "n_rbf": 20, "cutoff_fn": "cosine"},
        "painn": {"model": "schnetpack PaiNN + Atomwise", "n_rbf": 20, "cutoff_fn": "cosine"},
        "mace": {"model": f"mace-torch {mace_version or '(absent)'} ScaleShiftMACE, "
                          "trained by bench/models/molbench.py:train_for (not mace_run_train)",
                 **MACE_DEFAULTS, "hidden_irreps": args.mace_hidden_irreps,
                 "r_max": args.cutoff, "dtype": args.mace_dtype,
                 "forces": "-dE/dx by autograd (MACE's own output)",
                 "inputs": "MACE's input dict built from our batches, neighbours from "
                           "convergent.models.atoms.neighbor_list (not mace.data.AtomicData)",
                 "ignored_common": "hidden, layers (MACE's width and depth are hidden_irreps "
                                   "and num_interactions)"},
    }


def differences(args: argparse.Namespace, names: list[str]) -> list[str]:
    """The differences that remain between sides under the shared protocol, in words."""
    out = [
        "architectures differ (that is the comparison): parameter counts are in per_round",
        "equal thread-CPU time, not equal steps: a model that is cheaper per step sees more "
        "batches (train_steps, train_structures_per_cpu_second per round)",
        "schnetpack peers use their own radial basis (20 Gaussians, cosine cutoff); ours its "
        "own; both get neighbours from convergent.models.atoms.neighbor_list",
        f"the budget ({args.budget} thread-CPU s) is small for this 2-core shared machine: "
        "every model is under-trained; compare models within this run, not with other budgets",
    ]
    if "mace" in names:
        out.append(
            f"mace is MACE's own model (ScaleShiftMACE, {args.mace_hidden_irreps}, "
            f"{MACE_DEFAULTS['num_interactions']} interactions, max_ell {MACE_DEFAULTS['max_ell']}, "
            f"correlation {MACE_DEFAULTS['correlation']}, {MACE_DEFAULTS['num_bessel']} Bessel + "
            f"polynomial cutoff p={MACE_DEFAULTS['num_polynomial_cutoff']}) in {args.mace_dtype}, "
            "but trained by our loop under this protocol: not MACE's own recipe (mace_run_train's "
            "weighted energy/force loss, AMSGrad at lr 0.01, SWA/stage two, float64)")
    if "ours_bf16" in names:
        out.append("ours_bf16 trains and evaluates under bf16 autocast (the others fp32)")
    return out
