"""Stable molecular dynamics: do the trained potentials keep held-out molecules physical?

The test practitioners trust more than a test-set MAE ("Forces are not enough", Fu et al.
2023). Every side (``--models``: ours, schnet, painn, and mace when mace-torch imports) is
trained exactly as bench/models/accuracy.py trains it (bench/models/molbench_sides.py: same data,
folds, budget, loss, LR, EMA, batches), on the training molecules of fold ``--fold``; then,
on ``--molecules`` held-out molecules of that fold (picked with seed 0; start = the
molecule's first stored structure), it runs (bench/models/molbench_md.py, ASE):

* Langevin MD at each ``--temperatures`` (default 300 and 600 K) for ``--ps`` ps
  (``--timestep`` 0.5 fs, ``--friction`` 0.01/fs), checked every ``--record-every`` steps:
  a trajectory is *stable* when no bond of the start geometry is stretched beyond 1.5x its
  start length, no pair comes closer than 0.7 Å, the potential energy stays within 1 eV/atom
  of the start's and nothing is non-finite; the first failure's time and reason are kept.
  ``md_stable_fraction`` = stable trajectories / molecules, per side and temperature;
* NVE: ``--nve-thermalise-fs`` of Langevin at the first temperature, then ``--nve-ps`` of
  VelocityVerlet; the drift is the slope of a linear fit of total energy per atom vs time
  (eV/atom/ps; medians of its absolute value over the molecules that stayed stable);
* the radial distribution (all intramolecular pair distances, density per pair, averaged
  over frames, then molecules) of the first temperature's trajectories against GFN2-xTB MD
  (tblite) from the same starts and velocities, and the integrated absolute difference.

Seeds (``--seeds``, = the harness's rounds): round r trains every side with init/batch seed
``--seed`` + r; the MD starts and velocities are the same in every round and for xTB
(``--md-seed``), so the seeds measure the training's spread. Medians over seeds with spread.
Writes ``--out`` (bench/results/md_stability.json) and a PNG of the distributions next to it.
    .venv/bin/python -m bench.models.md_stability --ps 5 --molecules 20 --budget 1000 --seeds 3
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # tblite's OpenMP threads spin on a busy CPU

import numpy as np
import torch

from bench.lib.harness import Side, add_args, check_clean, interleave, stamp_png, write_result
from bench.models.molbench import evaluate
from bench.models.molbench_md import (
    Criteria,
    Trajectory,
    drift_per_atom_ps,
    mean_density,
    pair_distance_density,
    rdf_distance,
    rdf_edges,
    run_batched,
    run_md,
)
from bench.models.molbench_sides import (
    PEERS,
    Folds,
    add_training_args,
    check_data_args,
    common_settings,
    differences,
    fail,
    resolve_sides,
    side_settings,
    train_side,
)

MD_SIDES = ("ours", "ours_softmax", "ours_vectors", *PEERS)


def md_starts(test: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """``n`` held-out molecules (seed 0), each its first stored structure."""
    first: dict[str, dict[str, Any]] = {}
    for r in test:
        first.setdefault(r["molecule_id"], r)
    ids = sorted(first)
    np.random.default_rng(0).shuffle(ids)
    return [first[m] for m in ids[:n]]


def simulate_batched(model: Any, starts: list[dict[str, Any]], args: argparse.Namespace,
                     temperatures: list[float], nve: bool) -> dict[str, Any]:
    """:func:`simulate` for a trained model: each temperature's molecules (and the NVE
    runs) advanced together in one batch (molbench_md.run_batched, BatchMD), from the same
    starts and velocity seeds."""
    steps = round(args.ps * 1000 / args.timestep)
    kw = {"timestep_fs": args.timestep, "friction_per_fs": args.friction,
          "record_every": args.record_every, "criteria": Criteria(), "device": args.md_device}
    seeds = [args.md_seed * 1000 + i for i in range(len(starts))]
    out: dict[str, Any] = {"langevin": {}, "nve": [], "steps": steps, "record_every": args.record_every}
    for T in temperatures:
        out["langevin"][T] = run_batched(model, starts, T, steps, seeds, **kw)
    if nve:
        out["nve"] = run_batched(model, starts, temperatures[0], round(args.nve_ps * 1000 / args.timestep),
                                 seeds, ensemble="nve",
                                 thermalise_steps=round(args.nve_thermalise_fs / args.timestep), **kw)
    return out


def simulate(calc_of: Any, starts: list[dict[str, Any]], args: argparse.Namespace,
             temperatures: list[float], nve: bool, label: str) -> dict[str, Any]:
    """Every MD run of one calculator on ``starts``: {"langevin": {T: [Trajectory]},
    "nve": [Trajectory]}. ``calc_of()`` gives a fresh calculator per trajectory."""
    from tqdm import tqdm

    steps = round(args.ps * 1000 / args.timestep)
    out: dict[str, Any] = {"langevin": {T: [] for T in temperatures}, "nve": [], "steps": steps,
                           "record_every": args.record_every}
    jobs = [(T, i) for T in temperatures for i in range(len(starts))]
    if nve:
        jobs += [("nve", i) for i in range(len(starts))]
    for T, i in tqdm(jobs, desc=f"MD {label}", file=sys.stderr, mininterval=5):
        s = starts[i]
        kw = {"timestep_fs": args.timestep, "friction_per_fs": args.friction,
              "record_every": args.record_every, "criteria": Criteria()}
        if T == "nve":
            t0 = temperatures[0]
            traj = run_md(s["numbers"], s["positions"], calc_of(), t0,
                          round(args.nve_ps * 1000 / args.timestep), args.md_seed * 1000 + i,
                          ensemble="nve", thermalise_steps=round(args.nve_thermalise_fs / args.timestep),
                          **kw)
            out["nve"].append(traj)
        else:
            out["langevin"][T].append(run_md(s["numbers"], s["positions"], calc_of(), T, steps,
                                             args.md_seed * 1000 + i, **kw))
    return out


def density(trajs: list[Trajectory], edges: np.ndarray) -> np.ndarray:
    """The mean radial distribution of trajectories (frames up to any failure)."""
    return mean_density([pair_distance_density(np.stack(t.positions), edges) for t in trajs])


def md_metrics(runs: dict[str, Any], temperatures: list[float], edges: np.ndarray,
               ref_density: np.ndarray | None, starts: list[dict[str, Any]]) -> dict[str, Any]:
    """The row of one side and seed (or of the xTB reference)."""
    row: dict[str, Any] = {}
    steps = wall = cpu = 0.0
    for T in temperatures:
        trajs = runs["langevin"][T]
        tag = f"{T:g}K"
        row[f"stable_fraction_{tag}"] = float(np.mean([t.stable for t in trajs]))
        row[f"first_failure_ps_{tag}"] = [t.failed_at_ps for t in trajs]
        row[f"failure_reasons_{tag}"] = {starts[k]["molecule_id"]: t.reason
                                         for k, t in enumerate(trajs) if t.reason}
        for t in trajs:
            steps, wall, cpu = steps + t.steps, wall + t.wall_s, cpu + t.cpu_s
    if runs["nve"]:
        drifts = [drift_per_atom_ps(np.asarray(t.times_ps), np.asarray(t.total), len(s["numbers"]))
                  if t.stable and len(t.times_ps) > 1 else None for t, s in zip(runs["nve"], starts, strict=True)]
        ok = [abs(d) for d in drifts if d is not None]
        row["nve_drift_eV_per_atom_per_ps"] = drifts
        row["nve_abs_drift_median_eV_per_atom_per_ps"] = float(np.median(ok)) if ok else None
        row["nve_stable_fraction"] = float(np.mean([t.stable for t in runs["nve"]]))
        row["nve_failure_reasons"] = {starts[k]["molecule_id"]: t.reason
                                      for k, t in enumerate(runs["nve"]) if t.reason}
        for t in runs["nve"]:
            steps, wall, cpu = steps + t.steps, wall + t.wall_s, cpu + t.cpu_s
    g = density(runs["langevin"][temperatures[0]], edges)
    row[f"rdf_{temperatures[0]:g}K"] = g.tolist()
    # a failed trajectory contributes its frames up to the failure: how much of the whole
    frames = [len(t.positions) for t in runs["langevin"][temperatures[0]]]
    full = len(starts) * (1 + -(-runs["steps"] // runs["record_every"]))
    row[f"rdf_frame_coverage_{temperatures[0]:g}K"] = sum(frames) / max(full, 1)
    if ref_density is not None:
        row[f"rdf_distance_to_xtb_{temperatures[0]:g}K"] = rdf_distance(g, ref_density, edges)
    row.update(md_steps=int(steps), md_wall_seconds=wall, md_seconds_per_step=wall / max(steps, 1),
               md_cpu_seconds_per_step=cpu / max(steps, 1))
    return row


def side_runner(name: str, args: argparse.Namespace, folds: Folds, starts: list[dict[str, Any]],
                temperatures: list[float], edges: np.ndarray, ref: np.ndarray | None):  # noqa: ANN201
    def run(r: int) -> dict[str, Any]:
        train, test, _ = folds.get(args.fold)
        pot, n_params, _, tinfo = train_side(name, args, train, args.seed + r)
        acc = evaluate(pot, test)
        runs = simulate_batched(pot.model.to(args.md_device), starts, args, temperatures, True)
        row = md_metrics(runs, temperatures, edges, ref, starts)
        row.update(seed=args.seed + r, parameters=n_params, energy_mae=acc["energy_mae"],
                   force_mae=acc["force_mae"], train_steps=tinfo["steps"],
                   train_cpu_seconds=tinfo["cpu_seconds"], diverged_at_step=tinfo["diverged_at_step"])
        return row

    return run


def xtb_reference(starts: list[dict[str, Any]], args: argparse.Namespace, T: float,
                  edges: np.ndarray) -> dict[str, Any]:
    """GFN2-xTB (tblite) Langevin MD at ``T`` from the same starts and velocities."""
    from tblite.ase import TBLite

    runs = simulate(lambda: TBLite(method="GFN2-xTB", verbosity=0), starts, args, [T], False, "xTB")
    return md_metrics(runs, [T], edges, None, starts)


def plot(path: Path, edges: np.ndarray, curves: dict[str, np.ndarray], T: float, commit: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = 0.5 * (edges[1:] + edges[:-1])
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, g in curves.items():
        ax.plot(r, g, lw=2.2 if name == "xTB" else 1.2, color="k" if name == "xTB" else None, label=name)
    ax.set_xlabel("pair distance r (Å)")
    ax.set_ylabel("pair-distance density (1/Å, per pair)")
    ax.set_title(f"Intramolecular radial distribution, Langevin MD at {T:g} K (held-out molecules)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    stamp_png(path, commit, "md_stability")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(ap, default_out="bench/results/md_stability.json", rounds=3)
    ap.add_argument("--seeds", dest="rounds", type=int, help="training seeds (= --rounds)")
    add_training_args(ap)
    ap.add_argument("--fold", type=int, default=0, help="the fold whose held-out molecules run MD")
    ap.add_argument("--molecules", type=int, default=20, help="held-out molecules per side")
    ap.add_argument("--ps", type=float, default=5.0, help="picoseconds per Langevin trajectory")
    ap.add_argument("--temperatures", default="300,600", help="Langevin temperatures (K)")
    ap.add_argument("--nve-ps", type=float, default=None, help="NVE picoseconds (default --ps)")
    ap.add_argument("--nve-thermalise-fs", type=float, default=100.0,
                    help="Langevin fs at the first temperature before NVE")
    ap.add_argument("--timestep", type=float, default=0.5, help="fs")
    ap.add_argument("--friction", type=float, default=0.01, help="Langevin friction, 1/fs")
    ap.add_argument("--record-every", type=int, default=10, help="steps between checks/frames")
    ap.add_argument("--md-seed", type=int, default=0, help="seed of the MD velocities")
    ap.add_argument("--md-device", default="cpu", help="device of the batched MD (cpu, cuda)")
    ap.add_argument("--no-xtb", dest="xtb", action="store_false",
                    help="skip the xTB reference MD (no RDF distance)")
    args = ap.parse_args(argv)
    if args.nve_ps is None:
        args.nve_ps = args.ps
    try:
        args.temps = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        fail(f"--temperatures {args.temperatures!r}: expected comma-separated kelvins, e.g. 300,600")
    checks = [(args.rounds >= 1, "--seeds must be >= 1"), (args.molecules >= 1, "--molecules must be >= 1"),
              (0 < args.ps <= 1000 and 0 < args.nve_ps <= 1000, "--ps and --nve-ps must be in (0, 1000]"),
              (all(0 < t <= 5000 for t in args.temps), "--temperatures must be in (0, 5000] K"),
              (0 < args.timestep <= 5, "--timestep must be in (0, 5] fs"),
              (0 <= args.friction <= 1, "--friction must be in [0, 1] 1/fs"),
              (args.record_every >= 1, "--record-every must be >= 1"),
              (0 <= args.fold < args.folds, f"--fold must be in 0..{args.folds - 1}"),
              (args.nve_thermalise_fs >= 0, "--nve-thermalise-fs must be >= 0")]
    for ok, msg in checks:
        if not ok:
            fail(msg)
    check_data_args(args)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    names, skipped, mace_version = resolve_sides(args.models, allowed=MD_SIDES)
    check_clean(args)
    torch.set_num_threads(1)
    folds = Folds(args)
    _, test, _ = folds.get(args.fold)
    starts = md_starts(test, args.molecules)
    edges, T0 = rdf_edges(), args.temps[0]
    ref = xtb_reference(starts, args, T0, edges) if args.xtb else None
    ref_g = np.asarray(ref[f"rdf_{T0:g}K"]) if ref else None
    common, settings = common_settings(args), side_settings(args, mace_version)
    md = {"fold": args.fold, "molecules": [s["molecule_id"] for s in starts], "ps": args.ps,
          "temperatures_K": args.temps, "timestep_fs": args.timestep, "friction_per_fs": args.friction,
          "nve_ps": args.nve_ps, "nve_thermalise_fs": args.nve_thermalise_fs,
          "record_every_steps": args.record_every, "md_seed": args.md_seed,
          "criteria": vars(Criteria()), "integrators": "ASE Langevin / VelocityVerlet, centre of mass held by FixCom",
          "torch_threads": 1}
    sides = [Side(n, side_runner(n, args, folds, starts, args.temps, edges, ref_g),
                  {**common, **settings.get(n, {"model": n}), "md": md,
                   "md_engine": "convergent.screen.batchmd.BatchMD: every molecule of a "
                                "temperature in one batch, one model call a step (the xTB "
                                "reference: ASE's loop with tblite)"}) for n in names]
    res = interleave("md_stability", sides, rounds=args.rounds, differences=differences(args, names)
                     + ["every side runs MD from the same starts with the same velocity seeds; "
                        "the xTB reference too",
                        "a trajectory that failed adds its frames up to the failure to its side's "
                        "RDF (rdf_frame_coverage_*: the fraction of all frames present), so a side "
                        "that fails early is compared on near-start geometries"])
    res.extra["data"] = folds.describe(f"fold {args.fold}'s training molecules train every side; "
                                       f"{len(starts)} of its held-out molecules run MD")
    res.extra["xtb_reference"] = ref
    if skipped:
        res.extra["skipped_sides"] = skipped
    res.extra["command"] = " ".join(["python", "-m", "bench.models.md_stability", *sys.argv[1:]])
    res.extra["rdf_edges_A"] = edges.tolist()
    tags = [f"{T:g}K" for T in args.temps]
    res.headline["md_stable_fraction"] = {n: {t: res.median(n, f"stable_fraction_{t}") for t in tags}
                                          for n in names}
    res.headline["nve_abs_drift_eV_per_atom_per_ps"] = {
        n: res.median(n, "nve_abs_drift_median_eV_per_atom_per_ps") for n in names}
    if ref is not None:
        res.headline[f"rdf_distance_to_xtb_{tags[0]}"] = {
            n: res.median(n, f"rdf_distance_to_xtb_{tags[0]}") for n in names}
    res.headline["md_seconds_per_step"] = {n: res.median(n, "md_seconds_per_step") for n in names}
    if ref is not None:
        res.headline["md_seconds_per_step"]["xtb"] = ref["md_seconds_per_step"]
    out = write_result(res, args)
    curves = {n: np.mean([np.asarray(r[f"rdf_{tags[0]}"]) for r in res.per_round[n] if "error" not in r], axis=0)
              for n in names}
    if ref_g is not None:
        curves["xTB"] = ref_g
    plot(out.with_suffix(".png"), edges, curves, T0, res.provenance.get("commit"))
    return res.to_dict()


if __name__ == "__main__":
    main()
