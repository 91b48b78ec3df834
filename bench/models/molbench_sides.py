"""The sides of the molecular benchmarks and how each is built and trained: one place.

bench/models/accuracy.py (accuracy at equal budget) and bench/models/md_stability.py (MD with the
trained models) train every side the same way: the same datasets (:data:`DATASETS`), the
same molecule-wise folds (:class:`Folds`), the same model settings and training protocol
(:func:`add_training_args`, :func:`check_data_args`, :func:`model_config`, :func:`train_side`),
the same side names and checks (:func:`resolve_sides`) and the same settings record in the
JSON (:func:`common_settings`, :func:`side_settings`). ``nci2k`` (bench/models/nci2k.py) is split
by Bemis-Murcko scaffold instead, so no test scaffold is in training (asserted per fold).

Every side — ours, SchNet and PaiNN (``model.kind: schnet | painn``, schnetpack's) and MACE
(``model.kind: mace``, mace-torch's) — is a model kind of convergent and trains through the
one training loop (train/fit.py, the Trainer of ``convergent train``) for an equal budget of
thread-CPU seconds (``train.time_budget_s`` with ``train.budget_clock: thread_cpu``, one
torch thread, batches built in the training thread).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.models.molbench import OurPotential, molecule_folds, xtb_dataset, xtb_nci_dataset
from bench.models.nci2k import Nci2kSettings, group_folds, scaffold_group, split_report
from bench.models.nci2k import load as nci2k_load

PEERS = ("schnet", "painn", "mace")
SPK_PEERS = ("schnet", "painn")
SPK_RBF = 20  # Gaussians of the schnetpack peers' radial basis
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
    ap.add_argument("--warmup-steps", type=int, default=0, help="LR warm-up, optimizer steps")
    ap.add_argument("--models", default=None,
                    help="sides: ours, schnet, painn, mace, ours_softmax, ours_vectors, ours_bf16 "
                         "(default ours,schnet,painn plus mace when mace-torch imports)")
    ap.add_argument("--mace-dtype", default="float32", choices=("float32", "float64"),
                    help="MACE's dtype (it recommends float64 for MD and accuracy; float32 "
                         "is the others' precision and about twice as fast on this CPU)")
    ap.add_argument("--mace-channels", type=int, default=32,
                    help="MACE's channels per l of the hidden irreps (32x0e+32x1o; its own "
                         "default 128 is large for a CPU budget)")


def check_data_args(args: argparse.Namespace) -> None:
    """The data flags' cross-checks (exit 2 with one line, before any work)."""
    if args.data_chunks is not None and (args.dataset != "nci2k" or args.data_chunks < 1):
        fail(f"--data-chunks {args.data_chunks}: only with --dataset nci2k, and >= 1")


def resolve_sides(models: str | None, allowed: tuple[str, ...] = SIDES) -> tuple[list[str], dict[str, str], str | None]:
    """(side names, sides left out with the reason, MACE's version or None) for ``--models``;
    bad names or a named peer whose package is missing exit 2 (:func:`fail`)."""
    mace_ok, mace_info = _mace_available()
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
             "run: .venv/bin/pip install -e '.[schnetpack]'")
    return names, skipped, (mace_info if mace_ok else None)


def _mace_available() -> tuple[bool, str]:
    """(True, version) when mace-torch imports, else (False, the reason)."""
    from convergent.models.mace import import_mace

    try:
        import_mace()
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to skip the side
        return False, f"mace-torch not importable: {type(exc).__name__}: {exc}"
    return True, metadata.version("mace-torch")


def model_config(name: str, args: argparse.Namespace) -> Any:
    """The ``model`` section of side ``name``."""
    from convergent.models.config import MaceConfig, ModelConfig

    if name.startswith("ours"):
        weights = "softmax" if "softmax" in name else None  # else the model default (silu)
        return ModelConfig(hidden=args.hidden, layers=args.layers, heads=4, cutoff=args.cutoff,
                           vectors="vectors" in name,
                           **({"attention_weights": weights} if weights else {}))
    if name == "mace":
        return ModelConfig(kind="mace", mace=MaceConfig(r_max=args.cutoff, dtype=args.mace_dtype,
                                                        channels=args.mace_channels))
    return ModelConfig(kind=name, hidden=args.hidden, layers=args.layers, cutoff=args.cutoff,
                       num_rbf=SPK_RBF)


class _Datasets:
    """Each training list written once as a convergent dataset (train/fit.py reads one)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="molbench-"))
        self.paths: dict[int, tuple[list[dict[str, Any]], str]] = {}

    def path(self, records: list[dict[str, Any]]) -> str:
        from convergent.data.writer import write_records

        hit = self.paths.get(id(records))
        if hit is None or hit[0] is not records:
            out = self.root / f"train{len(self.paths)}"
            write_records(out, [{**r, "key": r.get("key") or f"{r.get('molecule_id', 'm')}/{i:06d}"}
                                for i, r in enumerate(records)])
            hit = self.paths[id(records)] = (records, str(out))
        return hit[1]


DATASETS_ON_DISK = _Datasets()


def fit_config(name: str, args: argparse.Namespace, data: str, seed: int,
               overrides: dict[str, dict[str, Any]] | None = None) -> Any:
    """The whole config of side ``name`` for train/fit.py: the shared protocol (module doc).
    ``args.device`` other than cpu trains there for ``args.budget`` wall seconds (batches
    prefetched, ``args.threads`` torch threads); ``overrides`` replace keys of the
    ``model``/``train`` sections (the ablations)."""
    from convergent.config import ConvergentConfig

    device = getattr(args, "device", "cpu")
    train = {"dataset": data, "steps": 10_000_000, "time_budget_s": args.budget,
             "budget_clock": "thread_cpu" if device == "cpu" else "wall", "lr": args.lr,
             "batch_atoms": getattr(args, "batch_atoms", BATCH_ATOMS),
             "force_weight": args.force_weight, "seed": seed, "ema_decay": args.ema,
             "warmup_steps": args.warmup_steps, "min_lr_ratio": 0.0, "lr_schedule": "cosine",
             "grad_clip": 10.0, "weight_decay": 0.0, "threads": getattr(args, "threads", 1),
             "device": device, "val_every": 0, "prefetch": 0 if device == "cpu" else 2}
    model = model_config(name, args).model_dump(mode="json")
    model.update((overrides or {}).get("model", {}))
    train.update((overrides or {}).get("train", {}))
    return ConvergentConfig.model_validate({
        "model": model, "train": train,
        "precision": {"dtype": "bf16" if name.endswith("bf16") else "fp32"},
        "checkpoint": {"interval": 0, "keep": 1, "resume": False, "at_end": False},
        "metrics": {"tensorboard": False, "mfu": False}})


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
    """The autocast dtype a side is evaluated under (its training precision)."""
    import torch

    return torch.bfloat16 if name.endswith("bf16") else None


def train_side(name: str, args: argparse.Namespace, train: list[dict[str, Any]],
               seed: int, overrides: dict[str, dict[str, Any]] | None = None,
               ) -> tuple[Any, int, Any, dict[str, Any]]:
    """Side ``name`` trained on ``train`` with ``seed`` through the one training loop under
    the shared protocol: (potential, parameter count, its model config, the run's record);
    the model is on ``args.device``."""
    from convergent.models.io import load_model
    from convergent.runsdb.trainrecords import read_train_records
    from convergent.train.fit import fit

    cfg = fit_config(name, args, DATASETS_ON_DISK.path(train), seed, overrides)
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as work:
        c0, w0 = time.thread_time(), time.perf_counter()
        summary = fit(cfg, Path(work) / "run", export_to=Path(work) / "model")
        cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
        model, _ = load_model(Path(work) / "model", getattr(args, "device", "cpu"))
        steps, _ = read_train_records(Path(work) / "run" / "metrics.jsonl", last_attempt=True)
    losses = [s.loss for s in steps if s.loss is not None]
    bad = [s.step for s in steps if s.loss is None or not math.isfinite(s.loss)]
    tinfo = {"steps": summary["steps"], "cpu_seconds": cpu, "wall_seconds": wall,
             "budget_thread_cpu_seconds": summary["budget"]["elapsed"],
             "steps_per_cpu_second": summary["steps"] / max(cpu, 1e-9),
             "final_loss_avg20": sum(losses[-20:]) / len(losses[-20:]) if losses else None,
             "diverged_at_step": bad[0] if bad else None}
    n_params = sum(p.numel() for p in model.parameters())
    return OurPotential(model), n_params, cfg.model, tinfo


def common_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The protocol every side shares (as written into the JSON)."""
    return {"dataset": args.dataset, "folds": args.folds, "budget_thread_cpu_s": args.budget,
            "lr": args.lr, "lr_rule": "one fixed LR for every model and every budget (no probe)",
            "optimizer": "AdamW, weight decay 0 (Adam's update), cosine to 0 over the budget",
            "warmup_steps": args.warmup_steps, "ema_decay": args.ema,
            "force_weight": args.force_weight, "batch_atoms": BATCH_ATOMS,
            "batch_order_seed": args.seed, "init_seed": args.seed, "torch_threads": 1,
            "hidden": args.hidden, "layers": args.layers, "cutoff_A": args.cutoff,
            "grad_clip_norm": 10.0,
            "references": "element reference energies + scale fitted on the fold's training set",
            "trainer": "train/fit.py (the Trainer of convergent train), train.time_budget_s "
                       "with budget_clock thread_cpu"}


def side_settings(args: argparse.Namespace, mace_version: str | None) -> dict[str, dict[str, Any]]:
    """Each side's own settings (as written into the JSON): its ``model`` section."""
    out = {n: {"model": model_config(n, args).model_dump(mode="json")} for n in SIDES
           if n != "mace" or mace_version}
    out["ours_bf16"]["autocast"] = "bf16 (CPU): precision.dtype=bf16"
    for n in SPK_PEERS:
        out[n]["network"] = f"schnetpack {n} + Atomwise (model.kind={n}), cosine cutoff"
    if mace_version:
        out["mace"]["network"] = (f"mace-torch {mace_version} ScaleShiftMACE (model.kind=mace), "
                                  "trained by the one loop (not mace_run_train)")
    return out


def differences(args: argparse.Namespace, names: list[str]) -> list[str]:
    """The differences that remain between sides under the shared protocol, in words."""
    out = [
        "architectures differ (that is the comparison): parameter counts are in per_round",
        "equal thread-CPU time, not equal steps: a model that is cheaper per step sees more "
        "batches (train_steps, train_steps_per_cpu_second per round)",
        f"schnetpack peers use their own radial basis ({SPK_RBF} Gaussians, cosine cutoff); "
        "ours its own; every side gets neighbours from convergent.models.atoms.neighbor_list",
        f"the budget ({args.budget} thread-CPU s) is small for this 2-core shared machine: "
        "every model is under-trained; compare models within this run, not with other budgets",
    ]
    if "mace" in names:
        out.append(
            f"mace is MACE's own model (ScaleShiftMACE, model.mace: channels {args.mace_channels}, "
            f"the rest model.mace's defaults) in {args.mace_dtype}, trained by our loop under "
            "this protocol: not MACE's own recipe (mace_run_train's weighted energy/force loss, "
            "AMSGrad at lr 0.01, SWA/stage two, float64)")
    if "ours_bf16" in names:
        out.append("ours_bf16 trains and evaluates under bf16 autocast (the others fp32)")
    return out
