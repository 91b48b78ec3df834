"""The surrogate half of bench/compress/inference.py: xTB-labelled data, a committee,
INT8, and the committee distilled into one student.

Data: GFN2-xTB (tblite) energies/forces of the NCI compounds shipped with RDKit (neutral,
H/C/N/O/F, <= 20 atoms, 8 conformers each: ETKDGv3 + MMFF94, rattled), the cached set of
bench/models/molbench.py (``xtb_nci_dataset``, built once, resumable), split by compound (20 %
held out, seed 0) into two dataset stores under bench/data/compression_inference/xtb-nci.

Reported on the held-out compounds: the per-element linear baseline (``E = sum_atoms
ref[Z]``, least squares on the training labels; what every surrogate starts from), each
committee member, the committee mean, its weight-only INT8 twin and the student, with
energy MAE (eV), energy MAE per atom, force MAE (eV/Å), structures/s, and Spearman of
energies per atom (INT8 vs fp32, student vs committee, model vs the labels).

Student: :func:`convergent.compress.distill.teacher_dataset` labels the training
structures and ``augment`` randomly displaced copies of each (unlabelled structures: the
teacher adds information the labels lack) with the committee mean; a smaller surrogate
is trained on them by ``convergent train`` for as many steps as a member.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.lib.harness import Side, interleave

# force_weight 0.05 (not the trainer's 10): at 10 the force term outweighs the per-atom
# energy term ~250x and 400 steps learn forces but barely beat the linear baseline on energy
SURROGATE = ["train.global_batch_atoms=256", "train.lr=2e-3", "train.force_weight=0.05",
             "model.hidden=64", "model.layers=2", "model.heads=4"]
# the student: ~6x cheaper per structure than a member (~18x than the committee of 3), so it
# gets 4x a member's steps (--student-steps): at 400 steps it stops at ~2x the committee's MAE
STUDENT = ["model.hidden=32", "model.layers=2", "model.heads=2"]
DATA_NOTE = ("GFN2-xTB (tblite) on the NCI compounds shipped with RDKit: neutral, H/C/N/O/F, "
             "<= 20 atoms, 8 conformers each (ETKDGv3 + MMFF94, rattled); split by compound, "
             "20 % held out (seed 0)")
KEYS = ("key", "molecule_id", "numbers", "positions", "energy", "forces")


def xtb_sets(work: Path) -> tuple[Path, Path]:
    """The train / held-out dataset stores (written once from molbench's cached set)."""
    from bench.models.molbench import molecule_split, xtb_nci_dataset
    from convergent.data.writer import write_records

    out = work / "xtb-nci"
    if not (out / "val" / "manifest.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        recs = xtb_nci_dataset()
        tr, va = molecule_split(recs, test_fraction=0.2, seed=0)
        for name, idx in (("train", tr), ("val", va)):
            write_records(out / name, [{k: recs[i][k] for k in KEYS} for i in idx],
                          compression="none")
    return out / "train", out / "val"


def read_all(path: Path) -> list[dict]:
    from convergent.data.reader import open_dataset

    ds = open_dataset(path)
    try:
        return [ds[i] for i in range(len(ds))]
    finally:
        ds.close()


class Baseline:
    """The per-element linear model fitted on the training labels, on the held-out set (in
    the store's order, which is the order of ``predict_dataset``'s results)."""

    def __init__(self, train: Path, val: Path) -> None:
        from convergent.models.molecular import fit_reference_energies

        ref = fit_reference_energies(read_all(train))
        recs = read_all(val)
        self.pred = np.array([sum(ref.energies.get(int(z), 0.0) for z in r["numbers"]) for r in recs])
        self.true = np.array([float(r["energy"]) for r in recs])
        self.n = np.array([len(r["numbers"]) for r in recs])
        self.mols = np.array([str(r["molecule_id"]) for r in recs], dtype=object)
        self.force_mae = float(np.concatenate([np.abs(r["forces"]).ravel() for r in recs]).mean())

    def residual(self, energy: np.ndarray) -> np.ndarray:
        """Energy per atom above the linear baseline: what a screen ranks once composition
        (which the baseline already gets right) is taken out."""
        return (energy - self.pred) / self.n

    def ranks(self, a: np.ndarray, b: np.ndarray) -> dict:
        """Spearman of ``a`` vs ``b`` (energies, eV): on the residual per atom over all
        held-out structures, and the mean over compounds of the conformer ranking."""
        within = [spearman(a[m], b[m]) for m in (self.mols == k for k in np.unique(self.mols))
                  if m.sum() >= 3]
        return {"spearman_residual": spearman(self.residual(a), self.residual(b)),
                "spearman_conformers_mean": float(np.nanmean(within))}

    def row(self) -> dict:
        err = np.abs(self.pred - self.true)
        return {"energy_mae_eV": float(err.mean()), "energy_mae_per_atom_eV": float((err / self.n).mean()),
                "force_mae_eV_per_A": self.force_mae,
                "note": "E = sum over atoms of a per-element energy (least squares on the "
                        "training labels); its forces are zero, so its force MAE is the mean |F| "
                        "of the labels; it ranks no conformers (constant per compound)"}


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def _quality(p: Any, base: Baseline) -> dict:
    ok = np.isfinite(p.energy_true)
    return {"energy_mae_eV": p.energy_mae, "force_mae_eV_per_A": p.force_mae_total,
            "energy_mae_per_atom_eV": float(np.mean(np.abs(p.energy_pred - p.energy_true)[ok]
                                                    / p.n_atoms[ok])),
            **{f"{k}_vs_labels": v for k, v in base.ranks(p.energy_pred, base.true).items()}}


def _timed(sides: dict[str, tuple[list[Path], str]], val: Path, name: str,
           rounds: int) -> tuple[dict, Any]:
    """Predict ``val`` with every side (model dirs, quantize), interleaved rounds."""
    from convergent.screen.predict import predict_dataset

    torch.set_num_threads(1)
    preds: dict[str, Any] = {}

    def side(n: str) -> Callable[[int], dict]:
        def run(r: int) -> dict:
            dirs, q = sides[n]
            res = predict_dataset(dirs, val, 2048, "cpu", quantize=q)
            preds[n] = res
            return {"structures_per_s": len(res) / res.seconds}
        return run

    h = interleave(name, [Side(n, side(n), {"models": [str(d) for d in sides[n][0]],
                                            "quantize": sides[n][1]}) for n in sides],
                   rounds, warmup=1)
    return preds, h


def _params(dirs: list[Path], quantize: str = "none") -> tuple[int, int]:
    from convergent.compress.qcheckpoint import load_surrogate
    from convergent.compress.quant import weight_bytes

    ms = [load_surrogate(d, quantize_method=quantize) for d in dirs]
    return sum(p.numel() for m in ms for p in m.parameters()), sum(weight_bytes(m) for m in ms)


def surrogates(args: argparse.Namespace, work: Path, train: Callable, out: dict, table: dict,
               rounds: dict) -> None:
    """Committee members (seeds), INT8 of member 0, teacher set, student; fills ``out``."""
    from convergent.compress.distill import teacher_dataset

    tr, va = xtb_sets(work)
    members = [train(f"member{k}", [f"train.dataset={tr}", f"train.val_dataset={va}",
                                    *SURROGATE, f"train.seed={k}"], args.surrogate_steps)[0]
               for k in range(args.committee)]
    shutil.rmtree(work / "teacher-set", ignore_errors=True)
    ts = teacher_dataset(members, tr, work / "teacher-set", augment=args.augment, sigma=0.05)
    student, _ = train("student", [f"train.dataset={ts.path}", f"train.val_dataset={va}",
                                   *SURROGATE, *STUDENT], args.student_steps)
    evaluate(members, student, ts, tr, va, args, out, table, rounds)


def evaluate(members: list[Path], student: Path, ts: Any, tr: Path, va: Path,
             args: argparse.Namespace, out: dict, table: dict, rounds: dict) -> None:
    """The surrogate rows of the table and the top-level ratios (trained models given)."""
    # quality and speed: INT8 vs fp32 (member 0); the committee vs its student
    sides = {"fp32": ([members[0]], "none"), "int8": ([members[0]], "int8"),
             "committee": (members, "none"), "student": ([student], "none")}
    preds, h = _timed(sides, va, "compression_inference.surrogate", args.rounds)
    base = Baseline(tr, va)
    rows: dict[str, Any] = {"linear-baseline": base.row()}
    for n, (dirs, q) in sides.items():
        rows[n] = _quality(preds[n], base)
        rows[n]["structures_per_s"] = h.median(n, "structures_per_s")
        rows[n]["parameters"], rows[n]["weight_bytes"] = _params(dirs, q)
    from convergent.screen.predict import predict_dataset

    rows["members"] = [_quality(predict_dataset([m], va), base) for m in members]
    e = {n: preds[n].energy_pred for n in sides}
    rows["int8"].update({f"{k}_vs_fp32": v for k, v in base.ranks(e["int8"], e["fp32"]).items()})
    rows["student"].update({f"{k}_vs_committee": v
                            for k, v in base.ranks(e["student"], e["committee"]).items()})
    rows["teacher_set"] = {"structures": ts.structures, "labelled_structures": ts.structures
                           // (args.augment + 1), "augment": args.augment, "sigma_A": 0.05,
                           "committee_energy_std_mean_eV": ts.energy_std_mean}
    rows["data"] = {"source": DATA_NOTE, "train_structures": len(read_all(tr)),
                    "val_structures": len(preds["fp32"])}
    lin, com, stu = rows["linear-baseline"], rows["committee"], rows["student"]
    out.update(
        surrogate_int8_mae_ratio=rows["int8"]["energy_mae_eV"] / rows["fp32"]["energy_mae_eV"],
        student_speedup=stu["structures_per_s"] / com["structures_per_s"],
        student_mae_ratio=stu["energy_mae_eV"] / com["energy_mae_eV"],
        surrogate_committee_energy_mae_eV=com["energy_mae_eV"],
        surrogate_committee_force_mae_eV_per_A=com["force_mae_eV_per_A"],
        surrogate_baseline_energy_mae_eV=lin["energy_mae_eV"],
        surrogate_baseline_to_committee_mae_ratio=lin["energy_mae_eV"] / com["energy_mae_eV"],
        student_spearman_vs_committee=stu["spearman_residual_vs_committee"],
        student_conformer_spearman_vs_committee=stu["spearman_conformers_mean_vs_committee"],
        surrogate_int8_spearman_vs_fp32=rows["int8"]["spearman_residual_vs_fp32"],
    )
    table["surrogate"], rounds["surrogate"] = rows, h.to_dict()
