"""The ceiling of uncertainty-driven selection in bench/learn/active_learning.py's campaign.

bench/learn/active_learning.py asks how many labels ours (committee disagreement + diversity
rules) needs to reach random selection's final held-out energy MAE. This bench asks how
many a *perfect* uncertainty would need: the same campaign (same pool, held-out set,
seeds, settings, committee, training steps, batches and diversity rules, via
``bench/learn/active_learning.py``'s ``SETTINGS``), except that a candidate's score is the
committee's true error ``|E_mean - E_ref| / n_atoms`` (eV/atom) instead of its spread.
For that, every pool structure is labelled beforehand with the campaign's own labelling
code (GFN2-xTB on the same Dask pool, same force trust limit); those labels are only
read by the score, never counted. Exploration MD frames have no label beforehand, so
the oracle cannot pick them (score NaN); ours rarely does under these settings.

Per seed (the rounds of bench/lib/harness.py, interleaved): oracle, then random. The
headline ``oracle_labels_ratio_vs_random`` is the median over seeds of the labels the
oracle needs to reach random's final energy MAE / random's labels (the statistic of
bench/learn/active_learning.py). It bounds from below what greedy uncertainty selection can
reach with this model, pool and budget. Writes bench/results/active_learning_ceiling.json.
Usage: ``python -m bench.learn.active_learning_ceiling [--seeds 0 1 2] [--allow-dirty]``.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.learn import active_learning as al
from bench.lib.harness import Side, add_args, check_clean, interleave, spread, write_result
from bench.lib.paths import RESULTS

# the oracle ranks by its score (top-k under ours' rules): a perfect uncertainty, no posterior
ORACLE = {"learn.select.acquisition": "top"}


def pool_labels(seed: int) -> dict[str, Any]:
    """Reference energy of every pool structure of ``seed`` (key -> eV), labelled with the
    campaign's own code on a fresh LocalCluster; and how many were quarantined."""
    from convergent.cluster.pool import dask_client
    from convergent.config import load_config
    from convergent.data.reader import open_dataset
    from convergent.learn.config import LEARN_PRESET
    from convergent.learn.engine import Pool
    from convergent.learn.loop import Campaign
    from convergent.runsdb.rundir import open_run

    path = al.WORK / f"pool-labels-s{seed}"
    shutil.rmtree(path, ignore_errors=True)
    cfg = load_config(None, al.overrides("uncertainty", seed), preset=LEARN_PRESET)
    run = open_run(cfg, path, command="learn")
    al._share_pool(path, seed)
    camp = Campaign(cfg, run, None, progress=False)
    al._keep_pool(path, seed)
    t0 = time.time()
    with dask_client(cfg.cluster) as client:
        camp.pool = Pool(client, path / "learn" / "timeline.jsonl")
        out = camp.label(0, camp.cands, len(camp.cands), "oracle-pool", dataset=path / "labels")
    ds = open_dataset(path / "labels")
    try:
        energy = {r["key"]: float(r["energy"]) for r in (ds[i] for i in range(len(ds)))}
    finally:
        ds.close()
    return {"energy": energy, "pool": len(camp.cands), "labelled": len(out.labelled),
            "quarantined": len(out.quarantined), "seconds": time.time() - t0}


def oracle_campaign(seed: int, energy: dict[str, float]) -> dict[str, Any]:
    """bench/learn/active_learning.py's ours, scored by the committee's true error."""
    from convergent.learn.loop import Campaign

    def true_error(self, rnd: int, cands: list) -> np.ndarray:
        p = self.predict(rnd, cands)
        ref = np.array([energy.get(c.key, np.nan) for c in cands], dtype=np.float64)
        return np.abs(p["energy_pred"] - ref) / np.maximum(p["n_atoms"], 1.0)

    original, settings = Campaign.score, dict(al.SETTINGS)
    Campaign.score = true_error
    al.SETTINGS.update(ORACLE)
    try:
        return al.run_campaign(f"oracle-s{seed}", "uncertainty", seed)
    finally:
        Campaign.score = original
        al.SETTINGS.clear()
        al.SETTINGS.update(settings)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    add_args(ap, str(RESULTS / "active_learning_ceiling.json"))
    args = ap.parse_args()
    check_clean(args)
    args.out = Path(args.out)
    al.WORK.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    results: dict[tuple[str, int], dict[str, Any]] = {}
    labelled: dict[int, dict[str, Any]] = {}

    def side(kind: str):
        def run(r: int) -> dict:
            seed = args.seeds[r]
            if kind == "oracle":
                labelled[seed] = pool_labels(seed)
                out = oracle_campaign(seed, labelled[seed]["energy"])
            else:
                out = al.run_campaign(f"random-s{seed}", "random", seed)
            results[(kind, seed)] = out
            last = out["curve"][-1]
            return {"seed": seed, "final_energy_mae_per_atom": last["energy_mae_per_atom"],
                    "final_force_mae": last["force_mae"], "labels": last["labels"],
                    "campaign_wall_s": out["wall_s"]}
        return run

    res = interleave("active_learning_ceiling", [
        Side("oracle", side("oracle"), {**al.SETTINGS, **ORACLE, "learn.select.strategy": "uncertainty",
                                        "score": "committee's true error |E_mean - E_ref| / n_atoms"}),
        Side("random", side("random"), {**al.SETTINGS, "learn.select.strategy": "random"})],
        rounds=len(args.seeds), differences=[
            "only the choice of each batch differs: the oracle ranks candidates by the committee's "
            "true energy error (labels of the whole pool computed beforehand, not counted), under "
            "ours' diversity rules; random draws",
            "the oracle cannot pick exploration MD frames (no label beforehand)"])
    per_seed = []
    for seed in args.seeds:
        orc, rnd = results[("oracle", seed)], results[("random", seed)]
        target = rnd["curve"][-1]["energy_mae_per_atom"]
        need = al.labels_to_reach(orc["curve"], target)
        per_seed.append({
            "seed": seed, "random_final_energy_mae_per_atom": target,
            "random_final_labels": rnd["curve"][-1]["labels"],
            "oracle_final_energy_mae_per_atom": orc["curve"][-1]["energy_mae_per_atom"],
            "oracle_labels_to_reach_random_final": need,
            "ratio": need / rnd["curve"][-1]["labels"] if need is not None else None,
            "pool": {k: v for k, v in labelled[seed].items() if k != "energy"}})
    ratios = [p["ratio"] if p["ratio"] is not None else float("inf") for p in per_seed]
    median = float(np.median(ratios))
    res.headline.update({
        "oracle_labels_ratio_vs_random": median if np.isfinite(median) else None,
        "target_of_bench_active_learning": "labels_ratio_vs_random <= 0.5",
        "per_seed": per_seed, "ratio_per_seed": spread([p["ratio"] for p in per_seed]),
        "curves": {f"{k}-s{s}": v["curve"] for (k, s), v in results.items()},
        "wall_s": time.time() - t0,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    })
    res.extra = {"versions": al.versions()}
    write_result(res, args)


if __name__ == "__main__":
    main()
