"""One retrospective campaign: one strategy, one seed, the pool's labels revealed on selection.

Round ``r`` trains a committee of ``rules.committee`` members on every label so far with
``convergent learn``'s worker code (:func:`convergent.learn.tasks.member_config` and
:func:`~convergent.learn.tasks.train_member`: the one training loop, train/fit.py, on the
GPU when ``rules.device`` is cuda; each member warm-started from its previous-round self,
seeded by (seed, round, member) as learn seeds it), evaluates the committee mean on the
held-out scaffolds (:func:`~convergent.learn.tasks.evaluate`: a point of the learning
curve), scores a seeded sample of the unlabelled pool with the committee
(:func:`~convergent.learn.tasks.score_records`, :func:`~convergent.learn.select.combined_score`)
and picks the batch with :func:`convergent.learn.select.select_batch` — the code and the
seeds of ``convergent learn``'s ``Campaign.candidates`` / ``Campaign.select``; only the
labels come from the :class:`~bench.learn.retrospective_data.LabelOracle` instead of xTB.
Every strategy of a seed shares the split, the initial labels and the members' seeds.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.learn.retrospective_data import LabelOracle, candidate, make_split, seed_of
from bench.learn.retrospective_rules import Rules, base_config, select_config


def elements_of(records: list[dict[str, Any]]) -> list[int]:
    """Atomic numbers present (the posterior's element-fraction columns)."""
    return sorted({int(z) for r in records for z in np.unique(r["numbers"])})


def _write(path: Path, records: list[dict[str, Any]]) -> str:
    from convergent.data.writer import write_records

    write_records(path, [{k: r[k] for k in ("key", "molecule_id", "numbers", "positions", "energy", "forces")}
                         for r in records])
    return str(path)


class Campaign:
    """The state of one campaign (module docstring); :meth:`run` returns its record."""

    def __init__(self, records: list[dict[str, Any]], rules: Rules, strategy: str, seed: int,
                 work: Path) -> None:
        self.rules, self.strategy, self.seed, self.work = rules, strategy, seed, work
        self.sel = select_config(rules, strategy)
        split = make_split(records, rules, seed)
        self.split_info = split.info
        pool_recs = [records[i] for i in split.pool]
        self.cands = [candidate(r) for r in pool_recs]  # the pool, unlabelled
        self.oracle = LabelOracle(pool_recs)
        self.elements = elements_of(pool_recs)
        test = [records[i] for i in split.test]
        self.test_cands = [candidate(r) for r in test]
        work.mkdir(parents=True, exist_ok=True)
        self.test_path = _write(work / "test", test)  # labelled: the held-out scaffolds
        self.base = base_config(rules)
        self.labelled: list[dict[str, Any]] = []
        self.times = {"train_s": 0.0, "score_s": 0.0, "select_s": 0.0, "eval_s": 0.0}

    # ------------------------------------------------------------------ labels
    def initial(self) -> list[int]:
        """``rules.init`` seeded random pool structures holding every element (learn's
        round 0: the same for every strategy of a seed)."""
        from convergent.learn.pool import cover_elements

        rng = np.random.default_rng(seed_of("init", self.seed))
        ranked = [self.cands[i] for i in rng.permutation(len(self.cands))]
        where = {id(c): i for i, c in enumerate(self.cands)}
        first = cover_elements(ranked, self.test_cands, self.rules.init)[:self.rules.init]
        return [where[id(c)] for c in first]

    def free(self, rnd: int) -> list[int]:
        """The round's candidates: a seeded sample of the unlabelled pool (learn.pool.sample)."""
        done = set(self.oracle.revealed)
        free = [i for i in range(len(self.cands)) if i not in done]
        n = self.rules.candidates
        if n and len(free) > n:
            rng = np.random.default_rng(seed_of("pool-sample", self.seed, rnd))
            free = [free[j] for j in sorted(rng.choice(len(free), n, replace=False))]
        return free

    # ------------------------------------------------------------------ committee
    def train(self, rnd: int, prev: list[str] | None) -> tuple[list[str], dict[str, Any]]:
        """Committee ``rnd`` on every label so far (learn.tasks.train_member, one by one)."""
        from convergent.learn import tasks

        R = self.rules
        data = _write(self.work / f"labels-r{rnd:02d}", self.labelled)
        members, steps, t0 = [], [], time.perf_counter()
        for k in range(R.committee):
            init = prev[k] if prev and R.warm_start else None
            train = self.base.train.model_copy(update={
                "dataset": data, "steps": R.steps if init else R.first_round_steps,
                "seed": seed_of("member", self.seed, rnd, k), "bootstrap": R.bootstrap,
                "init_from": init, "init_reference": "refit" if R.refit_reference else "keep"})
            out = self.work / f"r{rnd:02d}-m{k}"
            job = tasks.MemberJob(tasks.member_config(self.base, train), str(out))
            summary = tasks.train_member(job, R.device)
            members.append(str(out))
            steps.append(summary["steps"])
        self.times["train_s"] += time.perf_counter() - t0
        return members, {"member_steps": steps, "train_records": len(self.labelled)}

    def evaluate(self, rnd: int, members: list[str]) -> dict[str, Any]:
        from convergent.learn import tasks

        t0 = time.perf_counter()
        point = tasks.evaluate(members, self.test_path, self.rules.predict_batch_atoms, self.rules.device)
        self.times["eval_s"] += time.perf_counter() - t0
        return {"round": rnd, "labels": len(self.labelled), **point}

    def scores(self, members: list[str], free: list[int]) -> tuple[np.ndarray, Any]:
        """(score per candidate, posterior features or None) under the strategy's rules."""
        from convergent.learn import tasks
        from convergent.learn.select import combined_score

        S, R = self.sel, self.rules
        n = len(free)
        if S.strategy == "random":
            return np.full(n, np.nan), None
        recs = [self.cands[i].record() for i in free]
        posterior = S.acquisition == "posterior"
        lab = [{k: r[k] for k in ("key", "molecule_id", "numbers", "positions")} for r in self.labelled]
        p = tasks.score_records(members, recs + (lab if posterior else []), R.predict_batch_atoms,
                                R.device, elements=self.elements if posterior else None)
        p = {k: np.asarray(v, np.float64) for k, v in p.items()}
        if self.strategy == "oracle":  # the ceiling: the committee's true error
            ref = self.oracle.true_energy(free)
            s = np.abs(p["energy_pred"][:n] - ref) / np.maximum(p["n_atoms"][:n], 1.0)
        else:
            s = combined_score(p["energy_std"][:n], p["force_std_max"][:n], p["n_atoms"][:n],
                               S.force_weight)
        if not posterior:
            return s, None
        x = p["features"].reshape(n + len(lab), -1)
        return s, (x[:n], x[n:])

    def select(self, rnd: int, members: list[str], k: int) -> tuple[list[int], dict[str, Any]]:
        """The pool indices of round ``rnd``'s batch (at most ``k``) and what was seen."""
        from convergent.learn.select import select_batch

        free = self.free(rnd)
        t0 = time.perf_counter()
        s, feats = self.scores(members, free)
        t1 = time.perf_counter()
        cands = [self.cands[i] for i in free]
        labelled = ([(r["numbers"], r["positions"]) for r in self.labelled]
                    if self.sel.labelled_tol > 0 else ())
        picked = select_batch(cands, s, k, self.sel, seed=seed_of("select", self.seed, rnd),
                              exclude=frozenset(r["key"] for r in self.labelled),
                              labelled=labelled, features=feats)
        self.times["score_s"] += t1 - t0
        self.times["select_s"] += time.perf_counter() - t1
        chosen = [cands[j] for j in picked]
        finite = np.isfinite(s)
        return [free[j] for j in picked], {
            "round": rnd, "candidates": len(free), "selected": len(picked),
            "compounds": len({c.molecule_id for c in chosen}),
            "md_frames": sum(c.meta.get("kind") == "md" for c in chosen),
            "mean_score_selected": float(np.mean(s[picked])) if len(picked) and finite[picked].all() else None,
            "mean_score_all": float(np.mean(s[finite])) if finite.any() else None}

    # ------------------------------------------------------------------ the campaign
    def run(self) -> dict[str, Any]:
        R = self.rules
        t0, c0 = time.perf_counter(), time.process_time()
        init = self.initial()
        self.labelled = self.oracle.reveal(init, self.cands)
        curve, rounds, selected = [], [], [[self.cands[i].key for i in init]]
        prev: list[str] | None = None
        rnd = 1
        while True:
            members, info = self.train(rnd, prev)
            curve.append({**self.evaluate(rnd, members), **info})
            if prev:
                for d in prev:
                    shutil.rmtree(d, ignore_errors=True)
            prev = members
            if len(self.labelled) >= R.budget:
                break
            idx, row = self.select(rnd, members, min(R.batch, R.budget - len(self.labelled)))
            rounds.append(row)
            if not idx:  # the rules refuse every candidate left: the curve ends here
                break
            self.labelled += self.oracle.reveal(idx, self.cands)
            selected.append([self.cands[i].key for i in idx])
            rnd += 1
        import torch

        device = R.device if R.device == "cpu" or torch.cuda.is_available() else "cpu (no CUDA)"
        return {"strategy": self.strategy, "seed": self.seed, "device": device, "curve": curve, "rounds": rounds,
                "split": self.split_info, "labels": len(self.labelled),
                "revealed": [self.cands[i].key for i in self.oracle.revealed],
                "selected": selected, "oracle_peeked": len(self.oracle.peeked),
                "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, **self.times}


def run_campaign(records: list[dict[str, Any]], rules: Rules, strategy: str, seed: int,
                 work: Path) -> dict[str, Any]:
    """One campaign in this process, its files under ``work``; returns its record."""
    return Campaign(records, rules, strategy, seed, work).run()
