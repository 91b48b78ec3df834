"""Active learning on one shared pool: uncertainty+diversity (ours) against random selection.

Pool: conformers of small NCI compounds (the SMILES file shipped with RDKit, embedded with
ETKDGv3 + MMFF, then rattled); held out: the compounds a seeded hash puts aside, never in
the pool (their conformers are labelled once per campaign for the learning curve, not
counted as labels). Both strategies get the same settings: initial random labels, label
budget, batch per round, committee size and optimiser steps per member and round, and
the same exploration MD; only the choice of the batch differs. Three seeds (the seed
changes the split, the pool conformers, the initial labels and every training run).

Measured in the same run:
* ``labels_ratio_vs_random``: per seed, the labels ours needs to reach random's final
  held-out energy MAE (eV/atom; linear interpolation along ours' learning curve) divided
  by random's final label count; the median over seeds (null for a seed where ours never
  reaches it, counted as +inf in the median).
* ``utilisation``: busy core-seconds / available core-seconds of the pool for ours (seed
  0, pipelined); ``utilisation_sequential``: the same campaign run as strict phases.
* ``resume_identical``: ours (seed 0) run as a subprocess, its driver SIGKILLed during
  round 2's labelling and resumed with --resume, ends with the same dataset keys as the
  uninterrupted run, and no structure is labelled twice.

The seeds are the rounds of bench/lib/harness.py: per seed ours then random (interleaved);
every number over seeds is a median with its spread. Writes
bench/results/active_learning.json (+ active_learning.png, the curves, and
active_learning_timeline.png beside it). Usage:
``python -m bench.learn.active_learning [--seeds 0 1 2] [--set train.steps=60 ...]
[--allow-dirty]`` (``--set`` changes a setting for both strategies; the JSON records it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.harness import (
    Side,
    add_args,
    check_clean,
    interleave,
    spread,
    stamp_png,
    write_result,
)
from bench.lib.paths import DATA, RESULTS

WORK = DATA / "active_learning"

# One campaign: ~4 min on 2 shared cores. Every strategy gets exactly these settings.
# The pool is every small NCI compound of C/H/N/O (6-16 atoms) but the held-out ones, 8
# embedded+rattled conformers each, as a conformer search hands them over: most of a pool
# is close copies of structures already labelled, and which of them are worth a label is
# what selection decides. The training weights energies (the metric) over forces, and
# every member trains long enough to use the data it has (a short, force-dominated run
# left the held-out energy error flat at the element-reference level for every strategy).
SETTINGS = {
    "cluster.n_workers": 2,
    "model.hidden": 32, "model.layers": 2, "model.heads": 4,
    "simulate.source": "nci", "simulate.elements": "[C,H,N,O]", "simulate.min_atoms": 6,
    "simulate.max_atoms": 16, "learn.pool.conformers": 8,
    "simulate.rattle_sigma": 0.05, "learn.pool.sample": 0, "learn.pool.holdout_fraction": 0.25,
    "learn.pool.holdout_per_molecule": 4, "learn.label.init": 16, "learn.label.batch": 32,
    "learn.rounds": 5, "learn.label.budget": 176, "learn.committee": 4,
    "learn.members.first_round_steps": 1000, "train.steps": 500, "train.lr": 2e-3,
    "train.force_weight": 0.1, "learn.label.max_force": 50.0,
    "learn.explore.trajectories": 4, "learn.explore.steps": 40, "learn.explore.interval": 10,
    "learn.explore.temperature": 300.0,
    "learn.label.chunk": 4, "learn.select.score_chunk": 128, "learn.select.diversity_tol": 0.05,
    # used by ours only (random ignores scores): the energy spread alone (the metric is the
    # held-out energy; on seed 0 the force term gave 0.74x labels, energy alone 0.64x), one structure
    # per compound in a batch (the held-out set is other compounds), and no near-copy
    # (0.25 A: 99% of two conformers of one pool compound are closer) of a labelled one
    "learn.select.force_weight": 0.0, "learn.select.max_per_molecule": 1,
    "learn.select.labelled_tol": 0.25,
    # the batch: greedily the largest spread x (how much the candidate's label lowers the
    # mean last-layer posterior variance over the pool), conditioned on each pick
    # (convergent.learn.posterior; the spread alone, top-k, needed 0.69x the labels)
    "learn.select.acquisition": "posterior", "learn.select.posterior_gain": "pool",
    "learn.select.posterior_alpha": 1.0,
}


def overrides(strategy: str, seed: int, pipelined: bool = True) -> list[str]:
    s = dict(SETTINGS, **{"learn.select.strategy": strategy, "learn.seed": seed,
                          "learn.pipelined": str(pipelined).lower()})
    return [f"{k}={v}" for k, v in s.items()]


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for p in ("convergent", "torch", "dask", "distributed", "tblite", "rdkit", "ase", "numpy"):
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = "missing"
    return out


def run_campaign(name: str, strategy: str, seed: int, pipelined: bool = True) -> dict[str, Any]:
    """One campaign in this process (its own Dask LocalCluster); its curve and utilisation."""
    from convergent.config import load_config
    from convergent.learn.config import LEARN_PRESET
    from convergent.learn.engine import read_timeline
    from convergent.learn.loop import run_learning
    from convergent.learn.report import utilisation
    from convergent.runsdb.rundir import open_run

    path = WORK / name
    shutil.rmtree(path, ignore_errors=True)
    cfg = load_config(None, overrides(strategy, seed, pipelined), preset=LEARN_PRESET)
    run = open_run(cfg, path, command="learn")
    _share_pool(path, seed)
    t0 = time.time()
    summary = run_learning(cfg, run, progress=True)
    state = json.loads((path / "learn" / "state.json").read_text())
    curve = sorted(state["curve"].values(), key=lambda p: p["round"])
    u = utilisation(read_timeline(path / "learn" / "timeline.jsonl"))
    print(f"{name}: {summary['labels']} labels, final {curve[-1]['energy_mae_per_atom']:.4f} eV/atom, "
          f"utilisation {u['utilisation']:.3f}, {time.time() - t0:.0f} s", flush=True)
    return {"name": name, "strategy": strategy, "seed": seed, "pipelined": pipelined,
            "curve": curve, "utilisation": u, "wall_s": time.time() - t0,
            "rounds": [state["rounds"][k] for k in sorted(state["rounds"], key=int)]}


def _pool_cache(seed: int) -> Path:
    """Where the pool of this seed and these pool settings is kept between campaigns."""
    import hashlib

    keys = ("simulate.source", "simulate.elements", "simulate.min_atoms", "simulate.max_atoms",
            "simulate.max_molecules", "learn.pool.conformers", "simulate.rattle_sigma",
            "learn.pool.holdout_fraction", "learn.pool.holdout_per_molecule")
    tag = hashlib.blake2b(json.dumps([seed, [str(SETTINGS.get(k)) for k in keys]]).encode(),
                          digest_size=6).hexdigest()
    return WORK / f"pool-{tag}"


def _share_pool(path: Path, seed: int) -> None:
    """Reuse the pool built for this seed (embedding NCI compounds takes a while)."""
    cache = _pool_cache(seed)
    if (cache / "pool.npz").exists():
        (path / "learn").mkdir(parents=True, exist_ok=True)
        for f in ("pool.npz", "holdout.npz"):
            shutil.copy(cache / f, path / "learn" / f)


def _keep_pool(path: Path, seed: int) -> None:
    cache = _pool_cache(seed)
    if not (cache / "pool.npz").exists():
        cache.mkdir(parents=True, exist_ok=True)
        for f in ("pool.npz", "holdout.npz"):
            shutil.copy(path / "learn" / f, cache / f)


def labels_to_reach(curve: list[dict[str, Any]], target: float) -> float | None:
    """Labels at which a learning curve first reaches ``target`` (linear interpolation)."""
    xs = [p["labels"] for p in curve]
    ys = [p["energy_mae_per_atom"] for p in curve]
    if ys[0] <= target:
        return float(xs[0])
    for i in range(1, len(xs)):
        if ys[i] <= target:
            frac = (ys[i - 1] - target) / (ys[i - 1] - ys[i])
            return float(xs[i - 1] + frac * (xs[i] - xs[i - 1]))
    return None


def dataset_keys(path: Path) -> list[str]:
    from convergent.data.reader import open_dataset

    ds = open_dataset(path)
    try:
        return ds.keys()
    finally:
        ds.close()


def killed_and_resumed(seed: int, reference: Path) -> dict[str, Any]:
    """Ours as a subprocess, SIGKILLed during round 2's labels, then resumed."""
    path = WORK / "ours-killed"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    (path / "learn").mkdir()
    for f in ("pool.npz", "holdout.npz"):
        shutil.copy(reference / "learn" / f, path / "learn" / f)
    cmd = [sys.executable, "-c", "from convergent.cli import entry; entry()", "learn",
           "--run-dir", str(path)]
    for o in overrides("uncertainty", seed):
        cmd += ["--set", o]
    # the pool files are put in place first: the run directory must already be a run
    from convergent.config import load_config, save_config
    from convergent.learn.config import LEARN_PRESET
    from convergent.runsdb.rundir import RunDir

    save_config(load_config(None, overrides("uncertainty", seed), preset=LEARN_PRESET),
                RunDir(path).config)
    log = path / "learn" / "labels.jsonl"
    proc = subprocess.Popen([*cmd, "--resume"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    killed_at = None
    try:
        while proc.poll() is None:
            if log.exists():
                rounds = [json.loads(x)["round"] for x in log.read_text().splitlines() if x.strip()]
                if rounds.count(2) >= 3:
                    os.kill(proc.pid, signal.SIGKILL)
                    killed_at = {"round": 2, "labels_logged": len(rounds)}
                    break
            time.sleep(0.05)
        proc.wait(timeout=60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its Dask workers
        except ProcessLookupError:
            pass
    p = subprocess.run([*cmd, "--resume"], capture_output=True, text=True)
    keys = dataset_keys(path / "data" / "labels")
    logged = [json.loads(x)["key"] for x in log.read_text().splitlines() if x.strip()]
    ref = dataset_keys(reference / "data" / "labels")
    return {"killed": killed_at, "resume_rc": p.returncode,
            "resume_stderr_tail": p.stderr[-500:] if p.returncode else "",
            "keys_equal": sorted(keys) == sorted(ref), "labels": len(keys),
            "duplicates_in_dataset": len(keys) - len(set(keys)),
            "labelled_twice": len(logged) - len(set(logged)),
            "identical": bool(killed_at) and p.returncode == 0 and sorted(keys) == sorted(ref)
            and len(logged) == len(set(logged)) and len(keys) == len(set(keys))}


def plot(results: list[dict[str, Any]], out: Path) -> None:
    from convergent.learn.report import plot_curves

    curves: dict[str, list] = {"ours (uncertainty+diversity)": [], "random": []}
    for r in results:
        if r["pipelined"]:
            curves["ours (uncertainty+diversity)" if r["strategy"] == "uncertainty" else "random"].append(r["curve"])
    plot_curves(curves, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                    help="one round per seed (at least 3 for a spread)")
    ap.add_argument("--set", dest="sets", nargs="*", default=[],
                    help="change a setting for every side, e.g. learn.rounds=2 (smoke runs)")
    add_args(ap, str(RESULTS / "active_learning.json"))
    args = ap.parse_args()
    check_clean(args)
    args.out = Path(args.out)
    for item in args.sets:
        k, v = item.split("=", 1)
        SETTINGS[k] = v
    WORK.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    results: list[dict[str, Any]] = []

    def side(strategy: str):
        def run(r: int) -> dict:
            seed = args.seeds[r]
            name = f"{'ours' if strategy == 'uncertainty' else 'random'}-s{seed}"
            out = run_campaign(name, strategy, seed)
            _keep_pool(WORK / out["name"], seed)
            results.append(out)
            last = out["curve"][-1]
            return {"seed": seed, "final_energy_mae_per_atom": last["energy_mae_per_atom"],
                    "final_force_mae": last["force_mae"], "labels": last["labels"],
                    "utilisation": out["utilisation"]["utilisation"], "campaign_wall_s": out["wall_s"]}
        return run

    res = interleave("active_learning", [
        Side("ours", side("uncertainty"), {**SETTINGS, "learn.select.strategy": "uncertainty"}),
        Side("random", side("random"), {**SETTINGS, "learn.select.strategy": "random"})],
        rounds=len(args.seeds), differences=[
            "only the choice of each batch differs (uncertainty+diversity vs random); "
            "learn.select.force_weight, learn.select.max_per_molecule and learn.select.labelled_tol are read by ours only",
            "the seed of a round changes the split, the pool, the initial labels and the "
            "training runs alike for both strategies"])
    seq = run_campaign(f"ours-s{args.seeds[0]}-sequential", "uncertainty", args.seeds[0], pipelined=False)
    resume = killed_and_resumed(args.seeds[0], WORK / f"ours-s{args.seeds[0]}")
    per_seed = []
    for seed in args.seeds:
        ours = next(r for r in results if r["seed"] == seed and r["strategy"] == "uncertainty")
        rnd = next(r for r in results if r["seed"] == seed and r["strategy"] == "random")
        target = rnd["curve"][-1]["energy_mae_per_atom"]
        need = labels_to_reach(ours["curve"], target)
        per_seed.append({
            "seed": seed, "random_final_energy_mae_per_atom": target,
            "random_final_labels": rnd["curve"][-1]["labels"],
            "ours_final_energy_mae_per_atom": ours["curve"][-1]["energy_mae_per_atom"],
            "ours_final_force_mae": ours["curve"][-1]["force_mae"],
            "random_final_force_mae": rnd["curve"][-1]["force_mae"],
            "ours_labels_to_reach_random_final": need,
            "ratio": need / rnd["curve"][-1]["labels"] if need is not None else None,
            # the ratio only means something when random's curve went down: if its final
            # error is no better than the first (shared) point, ours 'reaches' it at once
            "random_improved": target < rnd["curve"][0]["energy_mae_per_atom"],
        })
    ratios = [p["ratio"] if p["ratio"] is not None else float("inf") for p in per_seed]
    median_ratio = float(np.median(ratios))
    ours0 = next(r for r in results if r["seed"] == args.seeds[0] and r["strategy"] == "uncertainty")
    res.headline.update({
        "labels_ratio_vs_random": median_ratio if np.isfinite(median_ratio) else None,
        "labels_ratio_reached_in_all_seeds": all(np.isfinite(ratios)),
        "labels_ratio_meaningful": all(p["random_improved"] for p in per_seed),
        "utilisation": ours0["utilisation"]["utilisation"],
        "utilisation_sequential": seq["utilisation"]["utilisation"],
        "resume_identical": resume["identical"],
        "targets": {"labels_ratio_vs_random": "<= 0.5", "utilisation": ">= 0.9"},
        "machine_note": "2 shared cores; other engineers' jobs may run at the same time "
                        "(see load averages): wall times are noisy, utilisation counts our workers' busy time",
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wall_s": time.time() - t0,
        "settings_changed_by_set": list(args.sets),
        "sequential_settings": {"learn.pipelined": False, "seed": args.seeds[0]},
        "per_seed": per_seed,
        "energy_mae_per_atom_final": {
            "ours": spread([p["ours_final_energy_mae_per_atom"] for p in per_seed]),
            "random": spread([p["random_final_energy_mae_per_atom"] for p in per_seed])},
        "force_mae_final": {
            "ours": spread([p["ours_final_force_mae"] for p in per_seed]),
            "random": spread([p["random_final_force_mae"] for p in per_seed])},
        "ratio_per_seed": spread([p["ratio"] for p in per_seed]),
        "utilisation_all_pipelined": spread([r["utilisation"]["utilisation"] for r in results]),
        "utilisation_detail": {"pipelined": ours0["utilisation"], "sequential": seq["utilisation"],
                               "pipelined_wall_s": ours0["wall_s"], "sequential_wall_s": seq["wall_s"]},
        "resume": resume,
        "curves": {r["name"]: r["curve"] for r in [*results, seq]},
        "campaign_rounds": {r["name"]: r["rounds"] for r in [*results, seq]},
    })
    res.extra = {"versions": versions()}
    write_result(res, args)  # first: it refuses a dirty tree, and the PNGs are tracked too
    figs = args.out.parent / args.out.stem
    plot(results, figs.with_suffix(".png"))
    from convergent.learn.engine import read_timeline
    from convergent.learn.report import plot_timeline

    plot_timeline(read_timeline(WORK / ours0["name"] / "learn" / "timeline.jsonl"),
                  figs.with_name(figs.name + "_timeline.png"), "ours, seed 0, pipelined")
    plot_timeline(read_timeline(WORK / seq["name"] / "learn" / "timeline.jsonl"),
                  figs.with_name(figs.name + "_timeline_sequential.png"), "ours, seed 0, sequential phases")
    for suffix in (".png", "_timeline.png", "_timeline_sequential.png"):
        stamp_png(figs.with_name(figs.name + suffix), res.provenance.get("commit"), "active_learning")
    print(json.dumps({k: res.headline[k] for k in ("labels_ratio_vs_random", "utilisation",
                                                   "utilisation_sequential", "resume_identical")}))


if __name__ == "__main__":
    main()
