"""Retrospective active learning on nci2k: ours vs random vs committee-spread top-k, and the
oracle ceiling, with the pool's labels revealed only on selection (issue 41, item 1).

The standard retrospective protocol: every structure of nci2k (bench/models/nci2k.py) is
labelled with GFN2-xTB beforehand; a campaign sees the pool — the structures of the
training scaffolds — without labels, and a label is revealed (and counted) only when its
structure is selected (:class:`~bench.learn.retrospective_data.LabelOracle`). The test set
is a fixed-size seeded sample of the held-out scaffolds' structures. Each strategy runs the
selection code of ``convergent learn`` (bench/learn/retrospective_campaign.py), its
committee trained by the one training loop. The rules and hyper-parameters are a frozen
dataclass (bench/learn/retrospective_rules.py) printed and written into the result JSON,
with their hash, before the first campaign starts; ``--print-rules`` prints them and exits,
``--expect-hash`` refuses to run under any other rules.

Per seed (the rounds of bench/lib/harness.py; every strategy of a seed shares the split,
the initial labels and the members' seeds):

* ``labels_ratio_vs_random`` — the labels ours needs to reach random's final held-out
  energy MAE (eV/atom; linear interpolation along ours' curve, bench/learn/active_learning.py's
  ``labels_to_reach``) / random's final labels; the median over seeds (a seed where ours
  never reaches it counts as +inf) and ``labels_ratio_per_seed`` (seed -> ratio, null
  where not reached); ``force_labels_ratio_*`` the same with the force MAE (eV/Å);
  ``oracle_*`` and ``spread_topk_*`` the same for the ceiling and the classic baseline.

Campaigns run ``--processes`` at a time (each alone in its process with one torch thread;
on a GPU they share it). Writes bench/results/active_learning_retrospective.json (+ .png:
energy and force MAE curves); the JSON is rewritten after each seed (``complete: false``
until the last). Usage::

    python -m bench.learn.retrospective --preset cpu            # ~37 min on 2 idle cores
    python -m bench.learn.retrospective --preset gpu --data bench/data/nci2k_v1_retro.npz
    python -m bench.learn.retrospective --preset smoke --out /tmp/retro.json --allow-dirty --allow-load
    python -m bench.learn.retrospective --export-npz bench/data/nci2k_v1_retro.npz
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from bench.learn.active_learning import labels_to_reach
from bench.learn.retrospective_campaign import run_campaign
from bench.learn.retrospective_data import describe, export_npz, load_records
from bench.learn.retrospective_rules import PRESETS, PROCESSES, Rules, rules_hash, with_overrides
from bench.lib.harness import (
    Side,
    check_clean,
    interleave,
    provenance,
    spread,
    stamp,
    stamp_png,
    write_result,
)
from bench.lib.paths import RESULTS

BENCH = "active_learning_retrospective"
TARGETS = {"labels_ratio_vs_random": "<= 0.5 (median over seeds)", "labels_ratio_per_seed": "<= 0.7 every seed"}
METRICS = {"": "energy_mae_per_atom", "force_": "force_mae"}
DIFFERENCES = [
    "only the choice of each batch differs: every strategy of a seed shares the split, the pool, "
    "the test set, the initial labels, the candidates' sampling rule, the committee's size, "
    "training steps and member seeds",
    "labels cost nothing here: the pool's GFN2-xTB labels exist beforehand and are revealed "
    "on selection; no surrogate-MD exploration (the prospective bench, "
    "bench/learn/active_learning.py, labels with xTB and explores)",
    "oracle reads the true energies of each round's candidates for its score only (never "
    "counted as labels, never trained on): a ceiling, not a strategy",
    "the curve's model is the committee mean; members are warm-started as convergent learn "
    "does, so a curve point at fewer labels also had fewer training steps: reaching random's "
    "final error early is harder than with a retrain per point (conservative for ours)",
]

_RECORDS: list[dict[str, Any]] | None = None  # a worker's records (loaded once per process)


def _init_worker(source: str) -> None:
    global _RECORDS
    _RECORDS = load_records(source)


def _job(rules: Rules, strategy: str, seed: int, work: str | None) -> dict[str, Any]:
    """One campaign in a worker (or in this process), in a temporary directory."""
    assert _RECORDS is not None, "records not loaded"
    with tempfile.TemporaryDirectory(prefix=f"retro-{strategy}-s{seed}-", dir=work) as d:
        out = run_campaign(_RECORDS, rules, strategy, seed, Path(d))
    assert out["revealed"] == [k for batch in out["selected"] for k in batch], "revealed unselected"
    keys = "\n".join(out.pop("revealed")).encode()
    out["revealed_hash"] = hashlib.blake2b(keys, digest_size=8).hexdigest()
    out.pop("selected")
    return out


# ----------------------------------------------------------------------------- statistics


def reach(curve: list[dict[str, Any]], metric: str, target: float) -> float | None:
    """Labels at which ``curve`` first reaches ``target`` in ``metric`` (interpolated)."""
    return labels_to_reach([{"labels": p["labels"], "energy_mae_per_atom": p[metric]} for p in curve], target)


def per_seed(camps: dict[tuple[str, int], dict[str, Any]], seeds: list[int], strategy: str,
             metric: str) -> list[dict[str, Any]]:
    """Per seed: random's final error and labels, the labels ``strategy`` needs, the ratio."""
    rows = []
    for seed in seeds:
        mine, rnd = camps.get((strategy, seed)), camps.get(("random", seed))
        if mine is None or rnd is None:
            continue
        target, final = rnd["curve"][-1][metric], rnd["curve"][-1]["labels"]
        need = reach(mine["curve"], metric, target)
        rows.append({"seed": seed, "random_final": target, "random_final_labels": final,
                     f"{strategy}_final": mine["curve"][-1][metric], "labels_to_reach": need,
                     "ratio": need / final if need is not None else None,
                     "random_improved": target < rnd["curve"][0][metric]})
    return rows


def median_ratio(rows: list[dict[str, Any]]) -> float | None:
    vals = [r["ratio"] if r["ratio"] is not None else float("inf") for r in rows]
    m = float(np.median(vals)) if vals else float("inf")
    return m if np.isfinite(m) else None


def headline(camps: dict[tuple[str, int], dict[str, Any]], rules: Rules) -> dict[str, Any]:
    """The named keys: each strategy's ratio (median, per seed) for energy and force MAE."""
    seeds = [s for s in rules.seeds if all((k, s) in camps for k in rules.strategies)]
    out: dict[str, Any] = {}
    detail: dict[str, Any] = {}
    for strategy in [s for s in ("ours", "oracle", "spread_topk") if s in rules.strategies]:
        name = "" if strategy == "ours" else f"{strategy}_"
        for prefix, metric in METRICS.items():
            rows = per_seed(camps, seeds, strategy, metric)
            out[f"{name}{prefix}labels_ratio_vs_random"] = median_ratio(rows)
            out[f"{name}{prefix}labels_ratio_per_seed"] = {str(r["seed"]): r["ratio"] for r in rows}
            detail[f"{strategy}_{metric}"] = rows
    ours = [r["ratio"] for r in detail.get("ours_energy_mae_per_atom", [])]
    med = out.get("labels_ratio_vs_random")
    out["done_when"] = {"median_le_0.5": med is not None and med <= 0.5,
                        "every_seed_le_0.7": bool(ours) and all(r is not None and r <= 0.7 for r in ours),
                        "seeds": seeds,
                        "random_improved_every_seed": all(r["random_improved"]
                                                          for r in detail.get("ours_energy_mae_per_atom", []))}
    out["targets"] = TARGETS
    out["per_seed_detail"] = detail
    out["final"] = {s: {m: spread([camps[(s, seed)]["curve"][-1][m] for seed in seeds])
                        for m in ("energy_mae_per_atom", "energy_mae", "force_mae", "labels")}
                    for s in rules.strategies}
    return out


# ----------------------------------------------------------------------------- the run


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="change the preset's seeds")
    ap.add_argument("--set", dest="sets", nargs="*", default=[], metavar="RULE=VALUE",
                    help="change a rule (the hash changes; the JSON records it)")
    ap.add_argument("--data", default="nci2k", help="nci2k (the built chunks) or an .npz of --export-npz")
    ap.add_argument("--processes", type=int, default=None,
                    help="campaigns at a time (default: the preset's; 0: in this process)")
    ap.add_argument("--work", default=None, help="where campaigns keep their files (default: tmp)")
    ap.add_argument("--print-rules", action="store_true", help="print the rules and their hash, exit")
    ap.add_argument("--expect-hash", default=None, help="refuse to run under rules with another hash")
    ap.add_argument("--export-npz", type=Path, default=None, help="write the records as an .npz, exit")
    ap.add_argument("--out", default=str(RESULTS / f"{BENCH}.json"), help="result JSON path")
    ap.add_argument("--allow-dirty", action="store_true", help="write from a dirty tree (dirty: true)")
    ap.add_argument("--allow-load", action="store_true", help="write from a busy machine (loaded: true)")
    ap.add_argument("--settle", type=float, default=150.0, metavar="S",
                    help="seconds to wait for the load to fall before starting (default 150)")
    return ap


def _rules_text(rules: Rules) -> str:
    return json.dumps({"preset": rules.preset, "rules_hash": rules_hash(rules), "rules": rules.to_dict()},
                      indent=1, default=str)


def _campaigns(rules: Rules, args: argparse.Namespace) -> tuple[Any, dict[tuple[str, int], Any]]:
    """Submit every campaign, seed by seed (the pool runs them in that order); none with
    ``--processes 0`` (each then runs in this process when its side asks)."""
    if args.processes == 0:
        return None, {}
    threads = str(max(1, (os.cpu_count() or 1) // args.processes))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, threads)  # numpy's BLAS in the workers: no oversubscription
    ctx = multiprocessing.get_context("spawn")  # torch in the workers: no fork
    pool = ProcessPoolExecutor(args.processes, mp_context=ctx, initializer=_init_worker,
                               initargs=(args.data,))
    futs = {(s, seed): pool.submit(_job, rules, s, seed, args.work)
            for seed in rules.seeds for s in rules.strategies}
    return pool, futs


def _plot(camps: dict[tuple[str, int], dict[str, Any]], rules: Rules, out: Path,
          commit: str | None) -> None:
    from convergent.learn.report import plot_curves

    curves = {s: [camps[(s, seed)]["curve"] for seed in rules.seeds if (s, seed) in camps]
              for s in rules.strategies}
    if plot_curves(curves, out):
        stamp_png(out, commit, BENCH)


def _row(c: dict[str, Any]) -> dict[str, Any]:
    """A campaign's numbers as the harness summarises them (per strategy, over seeds)."""
    last = c["curve"][-1]
    return {"seed": c["seed"], "final_energy_mae_per_atom": last["energy_mae_per_atom"],
            "final_energy_mae": last["energy_mae"], "final_force_mae": last["force_mae"],
            "labels": c["labels"], "campaign_wall_s": c["wall_s"], "campaign_cpu_s": c["cpu_s"],
            **{k: c[k] for k in ("train_s", "score_s", "select_s", "eval_s")}}


def _campaigns_json(camps: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    return {f"{s}-s{seed}": c for (s, seed), c in sorted(camps.items(), key=lambda kv: (kv[0][1], kv[0][0]))}


def run(rules: Rules, args: argparse.Namespace) -> dict[str, Any]:
    """Write the rules, run every campaign (interleaved by seed), write the result."""
    _init_worker(args.data)  # this process's records: what the JSON describes
    prov = provenance()
    head = {"complete": False, "preset": rules.preset, "rules_hash": rules_hash(rules),
            "rules": rules.to_dict(), "rules_written_utc": datetime.now(UTC).isoformat(timespec="seconds"),
            "rules_overrides": args.sets, "processes": args.processes,
            "data": describe(_RECORDS or [], args.data)}
    write_result(stamp(BENCH, prov, head, DIFFERENCES), args)  # the rules, before any seed runs
    t0 = time.time()
    head["first_campaign_started_utc"] = datetime.now(UTC).isoformat(timespec="seconds")
    pool, futs = _campaigns(rules, args)
    camps: dict[tuple[str, int], dict[str, Any]] = {}

    def side(strategy: str):
        def go(r: int) -> dict[str, Any]:
            seed = rules.seeds[r]
            c = futs[(strategy, seed)].result() if futs else _job(rules, strategy, seed, args.work)
            camps[(strategy, seed)] = c
            if strategy == rules.strategies[-1]:  # the seed is complete: keep it on disk
                partial = {**head, "seeds_done": list(rules.seeds[:r + 1]), **headline(camps, rules),
                           "campaigns": _campaigns_json(camps)}
                write_result(stamp(BENCH, prov, partial, DIFFERENCES), args)
            return _row(c)
        return go

    sides = [Side(s, side(s), {"select": dict(getattr(rules, s))}) for s in rules.strategies]
    try:
        res = interleave(BENCH, sides, rounds=len(rules.seeds), differences=DIFFERENCES)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    res.headline.update({
        **headline(camps, rules), **head, "complete": True, "wall_s": time.time() - t0,
        "statistic": "labels to reach random's final held-out error (linear interpolation along the "
                     "strategy's curve) / random's final labels; curve model: the committee mean",
        "campaigns": _campaigns_json(camps)})
    write_result(res, args)
    _plot(camps, rules, Path(args.out).with_suffix(".png"), res.provenance.get("commit"))
    return res.headline


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.export_npz is not None:
        print(json.dumps(export_npz(load_records(args.data), args.export_npz)))
        return 0
    try:
        rules = with_overrides(PRESETS[args.preset], args.sets, args.seeds)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(_rules_text(rules), flush=True)
    if args.print_rules:
        return 0
    if args.expect_hash and args.expect_hash != rules_hash(rules):
        print(f"error: the rules' hash is {rules_hash(rules)}, not {args.expect_hash}", file=sys.stderr)
        return 2
    if args.processes is None:
        args.processes = PROCESSES[args.preset]
    if rules.device == "cuda" and not _cuda():
        print(f"error: preset {rules.preset} trains on cuda, and torch sees no CUDA GPU", file=sys.stderr)
        return 2
    check_clean(args)
    head = run(rules, args)
    print(json.dumps({k: head[k] for k in head if "ratio" in k or k == "done_when"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
