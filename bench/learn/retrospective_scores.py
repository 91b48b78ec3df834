"""Which cheap score ranks the pool by the committee's true error? A diagnostic of the
retrospective bench (bench/learn/retrospective.py), not a result file.

One campaign's round 1 under the ``cpu`` preset's rules, with ``--extra`` more seeded random
labels beside the initial ones: the committee is trained as the bench trains it, the round's
candidates are scored, and each score is compared with the committee mean's true energy
error per atom (read from the pool's labels, never trained on): the Spearman correlation
over the candidates and the mean true error of the score's top ``batch`` over the mean of
all. The oracle of the bench takes the true error itself::

    python -m bench.learn.retrospective_scores --seed 0 --extra 0
    python -m bench.learn.retrospective_scores --seed 0 --extra 200
    python -m bench.learn.retrospective_scores --seed 10 --extra 120 --bootstrap

``--bootstrap`` trains the members on bootstrap resamples (``rules.bootstrap``) and adds a
learned error estimate: each labelled structure's out-of-bag error (the mean of the members
that did not draw it, against its label) fitted by ridge regression in log space on log
spread per atom, log atom count and the element fractions, then applied to the candidates.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np


def element_residual(labelled: list[dict], cands: list[dict], pred: np.ndarray, els: list[int]) -> np.ndarray:
    """|committee energy - a least-squares per-element fit to the labels| per atom."""
    def counts(rs):
        return np.array([[np.sum(np.asarray(r["numbers"]) == z) for z in els] for r in rs], float)
    ref = np.linalg.lstsq(counts(labelled), np.array([r["energy"] for r in labelled]), rcond=None)[0]
    return np.abs(pred - counts(cands) @ ref) / np.maximum(counts(cands).sum(1), 1.0)


def out_of_bag(c, members: list[str], data: str, preds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows of ``c.labelled`` with an out-of-bag member, their out-of-bag error per atom):
    ``preds`` [members, labelled] energies; member ``k`` drew the keys of its seeded resample."""
    from bench.learn.retrospective_data import seed_of
    from convergent.train.moldata import MoleculeSource

    keys = [r["key"] for r in c.labelled]
    inbag = []
    for k in range(len(members)):
        src = MoleculeSource(data, None, (), "key", seed_of("member", c.seed, 1, k))
        names = [np.asarray(ds.keys(), dtype=object) for ds in src.parts]
        inbag.append({str(names[int(pt)][int(rw)]) for pt, rw in zip(src._part, src._row, strict=True)})
    oob = np.array([[key not in bag for bag in inbag] for key in keys])
    rows = np.flatnonzero(oob.any(1))
    na = np.array([len(c.labelled[i]["numbers"]) for i in rows], float)
    e = np.array([preds[oob[i], i].mean() for i in rows])
    true = np.array([c.labelled[i]["energy"] for i in rows])
    return rows, np.abs(e - true) / na


def error_features(energy_std: np.ndarray, n_atoms: np.ndarray, x: np.ndarray, n_el: int) -> np.ndarray:
    """log spread per atom, log atom count and the element fractions (the features' last
    columns): what the error model sees of a structure, labelled or not."""
    return np.c_[np.log(energy_std / n_atoms + 1e-9), np.log(n_atoms), x[:, -n_el:]]


def fitted_error(feat_lab: np.ndarray, err: np.ndarray, feat_cand: np.ndarray) -> np.ndarray:
    """Ridge regression of log error on standardised features; the candidates' prediction."""
    mu, sd = feat_lab.mean(0), feat_lab.std(0) + 1e-9
    a = np.c_[(feat_lab - mu) / sd, np.ones(len(feat_lab))]
    w = np.linalg.solve(a.T @ a + np.eye(a.shape[1]), a.T @ np.log(err + 1e-6))
    return np.c_[(feat_cand - mu) / sd, np.ones(len(feat_cand))] @ w


def main(argv: list[str] | None = None) -> int:
    from scipy.stats import spearmanr

    from bench.learn.retrospective_campaign import Campaign
    from bench.learn.retrospective_data import load_records
    from bench.learn.retrospective_rules import PRESETS
    from convergent.learn import tasks
    from convergent.learn.posterior import Posterior

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--extra", type=int, default=0, help="random labels beside the initial ones")
    ap.add_argument("--data", default="nci2k")
    ap.add_argument("--bootstrap", action="store_true", help="bootstrap members and an error model")
    args = ap.parse_args(argv)
    import dataclasses

    R = dataclasses.replace(PRESETS["cpu"], bootstrap=args.bootstrap)
    c = Campaign(load_records(args.data), R, "ours", args.seed, Path(tempfile.mkdtemp(prefix="scores-")))
    init = c.initial()
    rng = np.random.default_rng(100 + args.seed)
    rest = [int(i) for i in rng.permutation(len(c.cands)) if i not in set(init)][:args.extra]
    c.labelled = c.oracle.reveal(init + rest, c.cands)
    members, _ = c.train(1, None)
    free = c.free(1)
    n = len(free)
    recs = [c.cands[i].record() for i in free]
    lab = [{k: r[k] for k in ("key", "molecule_id", "numbers", "positions")} for r in c.labelled]
    p = {k: np.asarray(v, np.float64) for k, v in tasks.score_records(
        members, recs + lab, R.predict_batch_atoms, R.device, elements=c.elements).items()}
    na = p["n_atoms"][:n]
    err = np.abs(p["energy_pred"][:n] - c.oracle.true_energy(free)) / na
    x = p["features"].reshape(n + len(lab), -1)
    post = Posterior(x[n:], x[:n], dict(R.ours).get("posterior_ridge", 1.0))
    xs = post.transform(x[:n])
    spread, var, pool = p["energy_std"][:n] / na, post.variance(xs), post.pool_gain(xs, xs.T @ xs / n)
    scores = {"spread": spread, "posterior_variance": var, "pool_gain": pool,
              "spread_x_pool_gain (ours, before the batch rules)": spread * pool,
              "spread_x_variance": spread * var,
              "element_fit_residual": element_residual(c.labelled, recs, p["energy_pred"][:n], c.elements),
              "n_atoms": na}
    if args.bootstrap:
        preds = np.array([tasks.score_records([m], lab, R.predict_batch_atoms, R.device)["energy_pred"]
                          for m in members])
        rows, oob_err = out_of_bag(c, members, str(c.work / "labels-r01"), preds)
        fl = error_features(p["energy_std"][n:], p["n_atoms"][n:], x[n:], len(c.elements))[rows]
        fc = error_features(p["energy_std"][:n], na, x[:n], len(c.elements))
        scores["fitted_oob_error"] = fitted_error(fl, oob_err, fc)
    out = {"seed": args.seed, "labels": len(c.labelled), "candidates": n, "bootstrap": args.bootstrap,
           "true_error_per_atom_median": float(np.median(err))}
    for name, s in scores.items():
        top = np.argsort(-s)[:R.batch]
        out[name] = {"spearman": round(float(spearmanr(s, err).statistic), 3),
                     "top_batch_error_over_mean": round(float(err[top].mean() / err.mean()), 2)}
    top = np.argsort(-err)[:R.batch]
    out["oracle"] = {"spearman": 1.0, "top_batch_error_over_mean": round(float(err[top].mean() / err.mean()), 2)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
