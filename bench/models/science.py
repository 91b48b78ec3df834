"""The surrogate at realistic scale on nci2k: accuracy at two equal-time budgets against
SchNet, PaiNN and MACE, batched MD stability, and the ablations that decide the model.

Data: nci2k (bench/models/nci2k.py: GFN2-xTB labels of 2,324 NCI compounds, MMFF conformers
and xTB Langevin frames), split by Bemis-Murcko scaffold (the balanced scaffold split, 20 %
held out, seed 0: many scaffolds, none of them in training; the largest groups, benzene's
first, stay in training). The test set is a seeded sample of
the held-out structures (``test_structures``).

Parts (``--part``, each its own JSON so one short GPU run can make each):

* ``accuracy``: ours, schnet, painn and mace, every side a convergent model kind trained by
  the one training loop (train/fit.py) for an equal time budget — thread-CPU seconds on the
  CPU preset, wall seconds on the GPU — at each of two budgets; rounds are seeds (init and
  batch order), sides interleaved. Energy MAE (eV per structure) and force MAE (eV/Å) on
  the held-out scaffolds. Headline: ``energy_mae_ratio_vs_best_peer`` and
  ``force_mae_ratio_vs_best_peer`` per budget (ours ÷ the best of the peers by median),
  ``best_peer`` per budget.
* ``md``: each side trained once (seed 0, the larger budget; the accuracy part's model when
  both run), then batched Langevin MD
  (convergent.screen.batchmd via bench/models/md_stability.simulate_batched) of held-out
  scaffold molecules at 300 and 600 K, and NVE after a short thermalisation:
  ``md_stable_fraction`` per side and temperature, NVE drift, and the RDF distance of the
  300 K trajectories to nci2k's own xTB Langevin frames (300 K) of the same compounds.
* ``ablations``: ours with one change at a time at the smaller budget (vector features,
  fewer radial functions, a shorter cutoff, force weight x10, no EMA, a constant LR, one
  reference energy per atom shared by every element instead of per-element references).

Presets (``--preset``): ``cpu`` sizes the whole of it to about 40 minutes on 2 cores (one
seed; its results say ``preset: cpu``); ``gpu`` is the device run (3 seeds, wall-second
budgets, 5 ps MD), each part sized for one short run. Usage:

    python -m bench.models.science --preset cpu --part all
    python -m bench.models.science --preset gpu --part accuracy   # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from bench.lib.harness import Side, add_args, check_clean, interleave, write_result
from bench.lib.paths import RESULTS
from bench.models.molbench import evaluate
from bench.models.molbench_sides import (
    add_training_args,
    common_settings,
    resolve_sides,
    train_side,
)

SIDES = ("ours", "schnet", "painn", "mace")


@dataclass(frozen=True)
class Preset:
    """How big each part is (recorded in the JSON)."""

    device: str
    budgets: tuple[float, float]  # seconds of training per side: thread-CPU (cpu) or wall
    seeds: int
    threads: int
    batch_atoms: int
    test_structures: int
    md_molecules: int
    md_ps: float
    md_timestep_fs: float
    nve_ps: float
    record_every: int


PRESETS = {
    "cpu": Preset(device="cpu", budgets=(60.0, 180.0), seeds=1, threads=1, batch_atoms=256,
                  test_structures=1500, md_molecules=20, md_ps=0.5, md_timestep_fs=0.5,
                  nve_ps=0.25, record_every=10),
    "gpu": Preset(device="cuda", budgets=(8.0, 24.0), seeds=3, threads=4, batch_atoms=4096,
                  test_structures=4000, md_molecules=24, md_ps=5.0, md_timestep_fs=1.0,
                  nve_ps=1.0, record_every=20),
}
ABLATIONS: dict[str, dict[str, dict[str, Any]]] = {
    "vectors": {"model": {"vectors": True}},
    "num_rbf_16": {"model": {"num_rbf": 16}},
    "cutoff_4": {"model": {"cutoff": 4.0}},
    "force_weight_x10": {"train": {"force_weight": 0.1}},
    "no_ema": {"train": {"ema_decay": 0.0}},
    "constant_lr": {"train": {"lr_schedule": "constant"}},
    "per_atom_reference": {"train": {"reference_fit": "per_atom"}},
}


def split(preset: Preset, data_chunks: int | None) -> tuple[list[dict], list[dict]]:
    """(train, held out): nci2k's balanced scaffold split, 20 % held out (seed 0)."""
    from bench.models.nci2k import balanced_scaffold_split, load, scaffold_group

    recs = load(chunks=data_chunks)
    tr, te = balanced_scaffold_split(recs, 0.2, seed=0)
    train, held_out = [recs[i] for i in tr], [recs[i] for i in te]
    assert not {scaffold_group(r) for r in train} & {scaffold_group(r) for r in held_out}
    return train, held_out


def side_args(args: argparse.Namespace, preset: Preset, budget: float) -> argparse.Namespace:
    """The shared protocol's flags for one budget on the preset's device."""
    return argparse.Namespace(**{**vars(args), "budget": budget, "device": preset.device,
                                 "threads": preset.threads, "batch_atoms": preset.batch_atoms})


_TRAINED: dict[tuple[str, float, int], tuple[Any, int, dict[str, Any]]] = {}


def trained(name: str, args: argparse.Namespace, train: list[dict], seed: int,
            overrides: dict[str, dict[str, Any]] | None = None) -> tuple[Any, int, dict[str, Any]]:
    """Side ``name`` trained at ``args.budget`` with ``seed`` (train_side); a model without
    overrides is trained once per run and reused by the other parts (md, the ablations'
    baseline)."""
    key = (name, float(args.budget), seed)
    if overrides or key not in _TRAINED:
        pot, n_params, _, info = train_side(name, args, train, seed=seed, overrides=overrides)
        if overrides:
            return pot, n_params, info
        _TRAINED[key] = (pot, n_params, info)
    return _TRAINED[key]


def accuracy_side(name: str, args: argparse.Namespace, data: tuple[list, list],
                  overrides: dict[str, dict[str, Any]] | None = None):  # noqa: ANN201
    """One side at one budget: round r = seed r."""
    train, test = data

    def run(r: int) -> dict[str, Any]:
        pot, n_params, info = trained(name, args, train, r, overrides)
        ev = evaluate(pot, test)
        return {"energy_mae": ev["energy_mae"], "energy_mae_per_atom": ev["energy_mae_per_atom"],
                "force_mae": ev["force_mae"], "parameters": n_params, "train_steps": info["steps"],
                "train_budget_seconds": info["budget_thread_cpu_seconds"],
                "diverged_at_step": info["diverged_at_step"]}

    return run


def vs_best_peer(res: Any, names: list[str], budgets: tuple[float, ...], metric: str) -> tuple[dict, dict]:
    """Per budget: ours ÷ the best peer's median of ``metric``, and that peer."""
    ratio, best = {}, {}
    for b in budgets:
        peers = [(res.median(f"{n}@{b:g}s", metric), n) for n in names if n != "ours"]
        peers = [(v, n) for v, n in peers if v is not None]
        ours = res.median(f"ours@{b:g}s", metric)
        if peers and ours is not None:
            v, n = min(peers)
            ratio[f"{b:g}s"], best[f"{b:g}s"] = ours / v, n
    return ratio, best


def part_accuracy(args: argparse.Namespace, preset: Preset, data: tuple, names: list[str]) -> Any:
    sides = [Side(f"{n}@{b:g}s", accuracy_side(n, side_args(args, preset, b), data),
                  {"model": n, "budget_s": b}) for b in preset.budgets for n in names]
    res = interleave("science_accuracy", sides, rounds=preset.seeds, differences=DIFFERENCES)
    for metric in ("energy_mae", "force_mae"):
        ratio, best = vs_best_peer(res, names, preset.budgets, metric)
        res.headline[f"{metric}_ratio_vs_best_peer"] = ratio
        res.headline[f"best_peer_by_{metric}"] = best
    res.headline["best_peer"] = res.headline["best_peer_by_energy_mae"]
    return res


def part_ablations(args: argparse.Namespace, preset: Preset, data: tuple) -> Any:
    a = side_args(args, preset, preset.budgets[0])
    sides = [Side("ours", accuracy_side("ours", a, data), {"change": "none"})]
    sides += [Side(f"ours_{k}", accuracy_side("ours", a, data, ov), {"change": ov})
              for k, ov in ABLATIONS.items()]
    res = interleave("science_ablations", sides, rounds=preset.seeds, differences=DIFFERENCES)
    res.headline["energy_mae_ratio_vs_ours"] = {s.name: res.ratio(s.name, "ours", "energy_mae")
                                               for s in sides[1:]}
    return res


DIFFERENCES = [
    "architectures differ (that is the comparison); parameter counts are in per_round",
    "equal training time, not equal steps: train_steps per round says how many each took",
    "every side: the same scaffold split, batches by atom budget, loss (per-atom energy MSE + "
    "force weight x force MSE), AdamW (weight decay 0), cosine LR over the budget, EMA, "
    "element references fitted on the training set, neighbours from convergent's neighbour list",
    "MACE is mace-torch's ScaleShiftMACE trained by this protocol, not by mace_run_train",
]


def md_reference(held_out: list[dict], starts: list[dict], edges: np.ndarray) -> np.ndarray:
    """The mean pair-distance density of nci2k's xTB Langevin frames (300 K) of the start
    compounds."""
    from bench.models.molbench_md import mean_density, pair_distance_density

    ids = {s["molecule_id"] for s in starts}
    frames: dict[str, list[np.ndarray]] = {}
    for r in held_out:
        if r.get("kind") == "md" and r["molecule_id"] in ids:
            frames.setdefault(r["molecule_id"], []).append(r["positions"])
    return mean_density([pair_distance_density(np.stack(f), edges) for f in frames.values()])


def md_side(name: str, args: argparse.Namespace, preset: Preset, train: list[dict],
            starts: list[dict], ref: np.ndarray):  # noqa: ANN201
    from bench.models.md_stability import md_metrics, simulate_batched
    from bench.models.molbench_md import rdf_edges

    md = argparse.Namespace(ps=preset.md_ps, timestep=preset.md_timestep_fs, friction=0.01,
                            record_every=preset.record_every, md_seed=0, md_device=preset.device,
                            nve_ps=preset.nve_ps, nve_thermalise_fs=100.0)

    def run(r: int) -> dict[str, Any]:
        pot, n_params, info = trained(name, side_args(args, preset, preset.budgets[-1]), train, r)
        runs = simulate_batched(pot.model, starts, md, TEMPERATURES, nve=True)
        row = md_metrics(runs, TEMPERATURES, rdf_edges(), ref, starts)
        row.update(parameters=n_params, train_steps=info["steps"])
        return row

    return run


TEMPERATURES = [300.0, 600.0]


def part_md(args: argparse.Namespace, preset: Preset, train: list, held_out: list, names: list[str]) -> Any:
    from bench.models.md_stability import md_starts
    from bench.models.molbench_md import rdf_edges

    starts = md_starts([r for r in held_out if r.get("kind") == "conformer"], preset.md_molecules)
    ref = md_reference(held_out, starts, rdf_edges())
    sides = [Side(n, md_side(n, args, preset, train, starts, ref), {"model": n}) for n in names]
    res = interleave("science_md", sides, rounds=1, differences=DIFFERENCES + [
        "MD: every side's molecules in one batch (BatchMD), the same starts and velocity seeds; "
        "RDF reference = nci2k's xTB Langevin frames (300 K) of the same compounds"])
    res.headline["md_stable_fraction"] = {
        n: {f"{T:g}K": res.median(n, f"stable_fraction_{T:g}K") for T in TEMPERATURES} for n in names}
    res.headline["md_starts"] = [s["molecule_id"] for s in starts]
    return res


def write_summary(preset: str, out_dir: Path) -> dict[str, Any]:
    """model_accuracy[_cpu].json: the headline keys of the parts of ``preset`` on disk (each
    with its commit) and the transfer result's ``transfer_energy_mae_eV``."""
    from convergent.core.fsutil import atomic_write_text, dumps_json

    out: dict[str, Any] = {"benchmark": "model_accuracy", "commit": None, "dirty": None,
                           "loaded": None, "preset": preset, "parts": {}}
    for part in ("accuracy", "md", "ablations"):
        p = out_dir / f"science_{part}_{preset}.json"
        if p.is_file():
            d = json.loads(p.read_text())
            out["parts"][part] = {"file": p.name, "commit": d.get("commit"),
                                  "device": d.get("device"), "loaded": d.get("loaded")}
            if out["commit"] is None:  # the first part's commit and provenance (the others
                out.update(commit=d.get("commit"), dirty=d.get("dirty"),  # name theirs)
                           loaded=d.get("loaded"), provenance=d.get("provenance"))
            out[f"{part}_summary"] = d.get("summary")  # medians with their spread
            for key in ("energy_mae_ratio_vs_best_peer", "force_mae_ratio_vs_best_peer",
                        "best_peer", "md_stable_fraction", "device"):
                if key in d:
                    out[key] = d[key]
    t = RESULTS / "transfer.json"  # the committed transfer result
    if t.is_file():
        d = json.loads(t.read_text())
        out["transfer_energy_mae_eV"] = d.get("transfer_energy_mae_eV")
        out["transfer_commit"] = d.get("commit")
    name = "model_accuracy.json" if preset == "gpu" else f"model_accuracy_{preset}.json"
    atomic_write_text(out_dir / name, dumps_json(out, indent=1) + "\n")
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(ap, default_out=str(RESULTS), rounds=1)
    add_training_args(ap)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--part", choices=("accuracy", "md", "ablations", "all"), default="all")
    ap.add_argument("--budgets", default=None, help="two budgets in seconds (default: the preset's)")
    ap.set_defaults(dataset="nci2k", models=",".join(SIDES))
    args = ap.parse_args(argv)
    preset = PRESETS[args.preset]
    if args.budgets:
        try:
            preset = replace(preset, budgets=tuple(float(b) for b in args.budgets.split(",")))
        except ValueError:
            print(f"error: --budgets {args.budgets!r}: expected seconds, e.g. 60,180", file=sys.stderr)
            sys.exit(2)
    args.preset_obj = preset
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    preset = args.preset_obj
    if preset.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: --preset gpu needs a CUDA GPU (none visible)", file=sys.stderr)
            sys.exit(2)
    names, skipped, mace_version = resolve_sides(args.models)
    check_clean(args)
    train, held_out = split(preset, args.data_chunks)
    test = held_out_sample(held_out, preset)
    parts = ("accuracy", "md", "ablations") if args.part == "all" else (args.part,)
    out_dir = Path(args.out)  # --out: the folder of the part files and the summary
    out_dir.mkdir(parents=True, exist_ok=True)
    for part in parts:
        if part == "accuracy":
            res = part_accuracy(args, preset, (train, test), names)
        elif part == "md":
            res = part_md(args, preset, train, held_out, names)
        else:
            res = part_ablations(args, preset, (train, test))
        res.headline.update(preset=args.preset, device=preset.device, skipped_sides=skipped)
        res.extra.update(preset=asdict(preset), protocol=common_settings(side_args(args, preset, 0.0)),
                         mace_version=mace_version, train_structures=len(train),
                         test_structures=len(test), command=" ".join(sys.argv))
        args.out = str(out_dir / f"science_{part}_{args.preset}.json")
        write_result(res, args)
    print(json.dumps(write_summary(args.preset, out_dir), indent=1))


def held_out_sample(held_out: list[dict], preset: Preset) -> list[dict]:
    """A seeded sample of ``test_structures`` of the held-out records (all when fewer)."""
    if len(held_out) <= preset.test_structures:
        return held_out
    idx = np.random.default_rng(0).choice(len(held_out), preset.test_structures, replace=False)
    return [held_out[i] for i in sorted(idx)]


if __name__ == "__main__":
    main()
