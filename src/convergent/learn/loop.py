"""The active-learning driver: rounds of train -> propose -> score -> select -> label.

>>> summary = run_learning(cfg, run)          # cfg.learn: LearnConfig; run: RunDir

Round ``r`` trains committee ``C_r`` (``K`` members, warm-started from ``C_{r-1}``) on
every label so far, evaluates it on the held-out molecules (a point of the learning
curve), scores the candidates — a seeded sample of the unlabelled pool and the frames
of short Langevin trajectories that ``C_{r-1}`` drove from labelled structures — by
committee disagreement, selects a batch and labels it. With ``pipelined`` the driver
only waits for the critical path (training, scoring, labelling): the exploration of the
next round (``learn.explore.chunk`` trajectories a task), the held-out labels and the
evaluations run at lower Dask priority in the gaps: the driver's selection, a batch's
last labels, a committee's last member (``pipelined=false``: strict phases).

Everything that decides the next step is on disk under ``<run>/learn/`` (pool, held-out
set, MD frames and selection of each round, ``state.json``) and in the labels dataset,
and every random choice is seeded by (seed, round, member), so a driver killed at any
point and rerun with ``--resume`` continues to the same dataset, labelling nothing twice.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from ase.data import atomic_numbers
from rich.console import Console

from convergent.cluster.pool import dask_client, job_kinds, watch_jobs
from convergent.config import ConvergentConfig
from convergent.core.fsutil import atomic_write_text, dumps_json
from convergent.data.format import MANIFEST_NAME
from convergent.data.reader import open_dataset
from convergent.learn import tasks
from convergent.learn.committee import MemberScores, joined
from convergent.learn.engine import Pool, gpu_wanted, gpu_worker
from convergent.learn.inputs import check_inputs as check_inputs  # the CLI's pre-flight
from convergent.learn.label import (
    LABEL_LOG,
    Background,
    committed_keys,
    label_batch,
    labelled_records,
    quarantined_keys,
)
from convergent.learn.paths import Paths
from convergent.learn.pool import (
    Candidate,
    build_pool,
    check_cover,
    cover_elements,
    dataset_molecules,
    load_candidates,
    save_candidates,
)
from convergent.learn.report import build_learn_report
from convergent.learn.select import combined_score, select_batch
from convergent.runsdb.rundir import RunDir
from convergent.sim.calculators import CalcSpec
from convergent.sim.molecules import stable_int
from convergent.sim.taskfarm import Job

console = Console(stderr=True)


def _seed(*parts: object) -> int:
    return stable_int(*parts) & 0x7FFFFFFF


class Campaign:
    """One campaign's driver state (see the module docstring)."""

    def __init__(self, cfg: ConvergentConfig, run: RunDir, pool: Pool | None = None,
                 progress: bool = True) -> None:
        self.cfg, self.L, self.p = cfg, cfg.learn, Paths(run)
        self.pool: Pool = pool  # type: ignore[assignment]  # set before run() when None
        self.progress = progress
        self.p.root.mkdir(parents=True, exist_ok=True)
        self.state: dict[str, Any] = (json.loads(self.p.state.read_text()) if self.p.state.exists()
                                      else {"members": {}, "rounds": {}, "elapsed_s": 0.0})
        self.t0 = time.time()
        self.cands, self.held = self._pool()
        self.md_futures: dict[int, list] = {}
        self.eval_futures: dict[int, Any] = {}
        self.held_bg: Background | None = None  # the held-out labels, pipelined
        self.early: dict[int, MemberScores | None] = {}  # score tasks submitted per member
        self.curve: dict[int, dict[str, Any]] = {int(k): v for k, v in self.state.get("curve", {}).items()}

    # ---------------------------------------------------------------- bookkeeping
    def say(self, text: str) -> None:
        if self.progress:
            console.print(text)

    def save(self) -> None:
        self.state["curve"] = {str(k): v for k, v in self.curve.items()}
        atomic_write_text(self.p.state, dumps_json(self.state, indent=2))

    def elapsed(self) -> float:
        return float(self.state.get("elapsed_s", 0.0)) + time.time() - self.t0

    def _pool(self) -> tuple[list[Candidate], list[Candidate]]:
        pool_f, held_f = self.p.root / "pool.npz", self.p.root / "holdout.npz"
        if pool_f.exists() and held_f.exists():
            return load_candidates(pool_f), load_candidates(held_f)
        pool, held = build_pool(self.L.pool, self.cfg.simulate, self.L.seed,
                                seen=dataset_molecules(self.L.label.init_dataset))
        save_candidates(held_f, held)
        save_candidates(pool_f, pool)
        self.say(f"pool: {len(pool)} structures; held out: {len(held)} structures")
        return pool, held

    def calc(self, rnd: int) -> dict[str, Any]:
        """The calculator of round ``rnd``: the simulate section's (PySCF from
        ``learn.label.dft_from_round`` on, with the section's DFT method or B3LYP)."""
        sim = self.cfg.simulate
        if self.L.label.dft_from_round and rnd >= self.L.label.dft_from_round and sim.calculator != "dft":
            method = sim.method if sim.calculator == "dft" else None
            sim = sim.model_copy(update={"calculator": "dft", "method": method})
        return CalcSpec.from_simulate(sim).to_dict()

    def labels_used(self) -> int:
        n = len(committed_keys(self.p.labels))
        return n + self.init_count()

    def labels_before(self, rnd: int, row: dict[str, Any] | None) -> int:
        """The labels committee ``rnd`` trains on: a resumed round's own labels (its batch,
        partly labelled before the driver was killed) and later rounds' do not count."""
        if row is not None:
            return int(row["labels_before"])
        n = self.labels_used()
        if (sel := self.p.selection(rnd)).exists():
            n -= len(committed_keys(self.p.labels) & set(json.loads(sel.read_text())["ranked"]))
        return n

    def init_count(self) -> int:
        if not self.L.label.init_dataset:
            return 0
        return len(committed_keys(Path(self.L.label.init_dataset)))

    def label(self, rnd: int, ranked: list[Candidate], k: int, strategy: str,
              scores: dict[str, float] | None = None, dataset: Path | None = None, kind: str = "label"):
        return label_batch(self.pool, dataset or self.p.labels, ranked, k, self.calc(rnd),
                           rnd=rnd, strategy=strategy, scores=scores, chunk=self.L.label.chunk,
                           retries=self.L.label.retries, min_distance=self.cfg.simulate.min_distance,
                           max_force=self.L.label.max_force, kind=kind,
                           log=self.p.root / LABEL_LOG if dataset is None else None)

    # ---------------------------------------------------------------- round 0
    def start(self) -> None:
        """Label the held-out set and the initial random labels (round 0); the initial
        labels hold every element of the pool and the held-out set (``cover_elements``).
        Pipelined, the held-out set is labelled in the background (below every critical
        kind) while the first committee trains: only the first evaluation waits for it."""
        init = []
        if not self.L.label.init_dataset:  # refused before any label is spent
            rng = np.random.default_rng(_seed("init", self.L.seed))
            ranked = [self.cands[i] for i in rng.permutation(len(self.cands))]
            init = cover_elements(ranked, self.held, self.L.label.init)
        held = functools.partial(self.label, 0, self.held, len(self.held), "holdout",
                                 dataset=self.p.holdout, kind="holdout")
        self.held_bg = Background(held) if self.L.pipelined else None
        n_held = "in the background" if self.held_bg else len(held().labelled)
        if init:
            out = self.label(0, init, self.L.label.init, "init")
            check_cover(self.cands, self.held, committed_keys(self.p.labels))
            self.say(f"round 0: {len(out.labelled)} initial labels ({len(out.quarantined)} "
                     f"quarantined); held-out labels: {n_held}")

    # ---------------------------------------------------------------- training
    def members(self, rnd: int) -> list[str]:
        return [str(self.p.member(rnd, k)) for k in range(self.L.committee)]

    def member_config(self, rnd: int, k: int, steps: int, init: str | None,
                      extra: list[str]) -> dict[str, Any]:
        """Member ``k``'s settings as a ``convergent train`` config
        (:func:`~convergent.learn.tasks.member_config`): the labels so far, ``steps``
        steps, warm-started from ``init``."""
        L = self.L
        data = [d for d in [str(self.p.labels), *extra] if (Path(d) / MANIFEST_NAME).is_file()]
        if not data:
            raise RuntimeError(f"round {rnd}: no labelled structures to train on")
        M = L.members
        train = self.cfg.train.model_copy(update={
            "dataset": data[0], "extra_datasets": data[1:], "steps": steps,
            "seed": _seed("member", L.seed, rnd, k), "bootstrap": M.bootstrap, "init_from": init,
            "init_reference": "refit" if M.refit_reference and not (rnd == 1 and M.init_model)
            else "keep"})
        return tasks.member_config(self.cfg, train)

    def train(self, rnd: int) -> dict[str, Any]:
        """Train (or, on resume, keep) the K members of round ``rnd``; retry crashed ones."""
        L = self.L
        done = set(self.state["members"].get(str(rnd), []))
        extra = [L.label.init_dataset] if L.label.init_dataset else []
        steps = (L.members.first_round_steps if rnd == 1 and not L.members.init_model
                 else self.cfg.train.steps)
        fault = str(self.p.root / marker) if (marker := _fault_marker()) is not None else None

        def job(k: int) -> Job:
            init = str(self.p.member(rnd - 1, k)) if rnd > 1 else L.members.init_model
            member = tasks.MemberJob(self.member_config(rnd, k, steps, init, extra),
                                     str(self.p.member(rnd, k)), fault)
            return Job("train", f"m{k}", tasks.train_member, (member,), {"device": "cpu"},
                       round=rnd, tag=k)  # the farm sets device to where "train" runs

        summaries: list[dict[str, Any]] = []
        retried = 0
        early = self.early.setdefault(rnd, self.early_scores(rnd)) if len(done) < L.committee else None

        def finished(j: Job, summary: dict[str, Any]) -> list[Job]:
            nonlocal retried
            retried += j.attempt
            summaries.append(summary)
            self.state["members"].setdefault(str(rnd), []).append(j.tag)
            self.save()
            if early is not None:  # this member scores the round's pool while the others train
                early.submit(j.tag)
            return []

        def failed(j: Job, exc: BaseException) -> list[Job]:
            raise RuntimeError(f"round {rnd}: committee member {j.tag} failed {j.attempt + 1} "
                               f"times: {type(exc).__name__}: {exc}") from None

        self.pool.run([job(k) for k in range(L.committee) if k not in done],
                      retries=L.members.retries, on_done=finished, on_failed=failed)
        return {"members_trained": len(summaries), "train_retries": retried, "train_steps": steps,
                "train_s": sum(s["seconds"] for s in summaries)}

    # ---------------------------------------------------------------- exploration
    def submit_md(self, rnd: int) -> None:
        """Exploration for round ``rnd`` driven by committee ``rnd - 1`` (background)."""
        L = self.L
        if rnd in self.md_futures or L.explore.trajectories == 0 or self.p.md(rnd).exists():
            return
        models = (self.members(rnd - 1) if rnd > 1
                  else [L.members.init_model] if L.members.init_model else [])
        if not models:
            return
        # start from the labels of rounds before rnd - 1: the same set whenever this runs
        source = (self.p.labels if committed_keys(self.p.labels)
                  else Path(L.label.init_dataset or self.p.labels))
        if not committed_keys(source):
            return
        ds = open_dataset(source)
        try:
            recs = sorted((r for r in ds if r["meta"].get("round", -1) <= max(rnd - 2, 0)),
                          key=lambda r: r["key"])
        finally:
            ds.close()
        rng = np.random.default_rng(_seed("md-start", L.seed, rnd))
        starts = [recs[i] for i in rng.choice(len(recs), size=min(len(recs), L.explore.trajectories),
                                              replace=False)]
        starts = [{"numbers": r["numbers"], "positions": r["positions"],
                   "molecule_id": r["molecule_id"], "key": r["key"]} for r in starts]
        E = L.explore
        seeds = [_seed("md", L.seed, rnd, j) for j in range(len(starts))]
        self.md_futures[rnd] = [  # ``chunk`` trajectories a task, start j seeded by j
            (self.pool.submit("explore", f"t{i}", rnd, tasks.explore_md, models, starts[i:i + E.chunk],
                              E.steps, E.interval, E.temperature, E.timestep_fs, E.friction,
                              seeds[i:i + E.chunk], device="cpu"), starts[i:i + E.chunk])
            for i in range(0, len(starts), E.chunk)]

    def md_candidates(self, rnd: int) -> list[Candidate]:
        """The exploration frames of round ``rnd`` (waits for them; saved for resume)."""
        path = self.p.md(rnd)
        if path.exists():
            return load_candidates(path)
        self.submit_md(rnd)
        out = []
        for f, starts in self.md_futures.pop(rnd, []):
            try:
                per_start = self.pool.result(f)
            except Exception as exc:  # exploration is optional: a failed task is dropped
                self.say(f"[yellow]round {rnd}: the exploration task failed: {exc}")
                continue
            for start, frames in zip(starts, per_start, strict=True):
                out += [Candidate.make(start["molecule_id"], start["numbers"], fr["positions"],
                                       origin="md", md_step=fr["step"], md_start=start["key"],
                                       md_round=rnd) for fr in frames]
        save_candidates(path, out)
        return out

    # ---------------------------------------------------------------- evaluation
    def submit_eval(self, rnd: int, labels: int) -> None:
        """Evaluate committee ``rnd`` (deferred while the held-out set is being labelled)."""
        if rnd in self.curve or (rnd in self.eval_futures and self.eval_futures[rnd][0]):
            return
        if self.held_bg is not None and not self.held_bg.done():
            self.eval_futures[rnd] = (None, labels)
            return
        if self.held_bg is not None:
            self.held_bg, _ = None, self.held_bg.join()  # its error, if it failed
        f = self.pool.submit("eval", "holdout", rnd, tasks.evaluate, self.members(rnd),
                             str(self.p.holdout), self.cfg.train.batch_atoms, device="cpu")
        self.eval_futures[rnd] = (f, labels)

    def collect_eval(self, rnd: int) -> dict[str, Any] | None:
        if rnd not in self.curve and rnd in self.eval_futures:
            if self.eval_futures[rnd][0] is None and self.held_bg is not None:  # wait for the
                self.held_bg.join()  # held-out labels
                self.submit_eval(rnd, self.eval_futures[rnd][1])
            f, labels = self.eval_futures.pop(rnd)
            self.curve[rnd] = {"round": rnd, "labels": labels, **self.pool.result(f)}
            self.save()
        return self.curve.get(rnd)

    # ---------------------------------------------------------------- scoring
    def member_scores(self, rnd: int, records: list[dict[str, Any]], features: bool) -> MemberScores:
        """Committee ``rnd``'s score tasks on ``records`` (:mod:`convergent.learn.committee`)."""
        elements = [atomic_numbers[e] for e in self.cfg.simulate.elements] if features else None
        return MemberScores(self.pool, rnd, self.members(rnd), records, self.L.select.score_chunk,
                            self.cfg.train.batch_atoms, elements)

    def predict(self, rnd: int, cands: list[Candidate], records: list[dict[str, Any]] | None = None,
                features: bool = False) -> dict[str, np.ndarray]:
        """Committee ``rnd`` on ``cands`` (or on ``records``): arrays ``energy_pred``,
        ``energy_std``, ``force_std_max``, ``n_atoms`` and, with ``features``, the
        last-layer ``features`` (:mod:`convergent.learn.posterior`)."""
        recs = records if records is not None else [c.record() for c in cands]
        return joined([self.member_scores(rnd, recs, features).collect()])

    def score(self, rnd: int, cands: list[Candidate]) -> np.ndarray:
        p = self.predict(rnd, cands)
        return combined_score(p["energy_std"], p["force_std_max"], p["n_atoms"], self.L.select.force_weight)

    def pool_candidates(self, rnd: int, exclude: set[str]) -> list[Candidate]:
        """A seeded sample of the unlabelled pool (the exploration frames come on top)."""
        L = self.L
        free = [c for c in self.cands if c.key not in exclude]
        if L.pool.sample and len(free) > L.pool.sample:
            rng = np.random.default_rng(_seed("pool-sample", L.seed, rnd))
            free = [free[i] for i in sorted(rng.choice(len(free), L.pool.sample, replace=False))]
        return free

    def early_scores(self, rnd: int) -> MemberScores | None:
        """Pipelined, posterior acquisition: the score tasks of round ``rnd``'s pool sample
        and labels, each member's submitted when it is trained (:meth:`train`)."""
        L = self.L
        if not (L.pipelined and L.select.strategy == "uncertainty" and L.select.acquisition == "posterior"
                and str(rnd) not in self.state["rounds"] and rnd <= L.rounds
                and self.labels_used() < L.label.budget and not self.p.selection(rnd).exists()):
            return None
        exclude = committed_keys(self.p.labels) | quarantined_keys(self.p.labels)
        recs = [c.record() for c in self.pool_candidates(rnd, exclude)] + labelled_records(self.p.labels)
        return self.member_scores(rnd, recs, features=True)

    def select(self, rnd: int, k: int) -> tuple[list[Candidate], dict[str, float]]:
        """The ranked candidates of round ``rnd`` (computed once, then read from disk)."""
        path = self.p.selection(rnd)
        if path.exists():
            sel = json.loads(path.read_text())
            by_key = {c.key: c for c in self.cands}
            by_key.update({c.key: c for c in self.md_candidates(rnd)})
            return [by_key[x] for x in sel["ranked"]], sel["scores"]
        L, S = self.L, self.L.select
        exclude = committed_keys(self.p.labels) | quarantined_keys(self.p.labels)
        free = self.pool_candidates(rnd, exclude)
        cands = free + [c for c in self.md_candidates(rnd) if c.key not in exclude]
        feats = None
        lab_recs = labelled_records(self.p.labels) if S.labelled_tol > 0 or S.acquisition == "posterior" else []
        if S.strategy != "uncertainty":
            scores = np.full(len(cands), np.nan)
        elif S.acquisition == "posterior":  # the candidates' and the labels' last-layer features
            a, nf, n = [c.record() for c in free] + lab_recs, len(free), len(cands)  # then MD frames
            early = self.early.pop(rnd, None)
            if early is None or early.keys != [r["key"] for r in a]:
                early = self.member_scores(rnd, a, features=True)
            md = self.member_scores(rnd, [c.record() for c in cands[nf:]], features=True).submit_all()
            pa = early.collect()  # the MD frames' tasks run meanwhile
            p = joined([{k: v[:nf] for k, v in pa.items()}, md.collect(), {k: v[nf:] for k, v in pa.items()}])
            scores = combined_score(p["energy_std"][:n], p["force_std_max"][:n], p["n_atoms"][:n], S.force_weight)
            x = p["features"].reshape(n + len(lab_recs), -1)
            feats = (x[:n], x[n:])
        else:
            scores = self.score(rnd, cands)
        labelled = [(r["numbers"], r["positions"]) for r in lab_recs] if S.labelled_tol > 0 else ()
        picked = select_batch(cands, scores, 2 * k + 4, S, seed=_seed("select", L.seed, rnd),
                              exclude=exclude, labelled=labelled, features=feats)
        ranked = [cands[i] for i in picked]
        by = {cands[i].key: float(scores[i]) for i in picked if np.isfinite(scores[i])}
        atomic_write_text(path, dumps_json({
            "round": rnd, "strategy": S.strategy, "k": k, "ranked": [c.key for c in ranked],
            "scores": by, "candidates": len(cands),
            "from_md": sum(1 for c in cands if c.origin == "md"),
            "mean_score_all": float(np.nanmean(scores)) if np.isfinite(scores).any() else None,
        }, indent=1))
        return ranked, by

    # ---------------------------------------------------------------- the campaign
    def run(self) -> dict[str, Any]:
        L = self.L
        self.start()
        stop = None
        rnd = 1
        while True:
            done_row = self.state["rounds"].get(str(rnd))
            labels_now = self.labels_before(rnd, done_row)
            t_round = time.time()
            tr = self.train(rnd)
            self.submit_eval(rnd, labels_now)
            if not L.pipelined:
                self.collect_eval(rnd)
            final = rnd > L.rounds or labels_now >= L.label.budget
            if done_row is None and not final:
                if L.pipelined and rnd + 1 <= L.rounds:
                    self.submit_md(rnd + 1)  # explores for the next round while this one works
                k = min(L.label.batch, L.label.budget - labels_now)
                if not L.pipelined:
                    self.md_candidates(rnd)
                ranked, scores = self.select(rnd, k)
                out = self.label(rnd, ranked, k, L.select.strategy, scores)
                sel = json.loads(self.p.selection(rnd).read_text())
                row = {"round": rnd, "labels_before": labels_now, "selected": len(out.labelled),
                       "quarantined": len(out.quarantined), "refills": out.refills,
                       "candidates": sel["candidates"], "from_md": sel["from_md"],
                       "mean_score_selected": float(np.mean([scores[c.key] for c in ranked[:k] if c.key in scores]))
                       if scores else None,
                       "mean_score_all": sel["mean_score_all"], "label_s": out.seconds,
                       "wall_s": time.time() - t_round, **tr}
                self.state["rounds"][str(rnd)] = row
                with self.p.rounds.open("a", encoding="utf-8") as fh:
                    fh.write(dumps_json(row) + "\n")
                self.save()
                self.say(f"round {rnd}: trained {L.committee} members ({tr['train_retries']} retried), "
                         f"labelled {len(out.labelled)} of {row['candidates']} candidates "
                         f"({row['from_md']} from MD; {len(out.quarantined)} quarantined, "
                         f"{out.refills} refilled); labels {self.labels_used()}")
            point = self.collect_eval(rnd)
            if point is not None:
                self.say(f"round {rnd}: held-out energy MAE {point['energy_mae_per_atom']:.4f} eV/atom, "
                         f"force MAE {point['force_mae']:.4f} eV/Å at {point['labels']} labels")
            if final:
                stop = stop or ("label budget" if labels_now >= L.label.budget else "rounds")
                break
            if L.target_energy_mae and point and point["energy_mae_per_atom"] <= L.target_energy_mae:
                stop = "target error"
                break
            if L.wall_budget_s and self.elapsed() >= L.wall_budget_s:
                stop = "wall-time budget"
                break
            rnd += 1
        for futs in self.md_futures.values():  # exploration nobody needs any more
            for f, _ in futs:
                f.cancel()
        self.state["stop"] = stop
        self.state["final_round"] = rnd
        self.state["elapsed_s"] = self.elapsed()
        self.t0 = time.time()
        self.save()
        return {"rounds": rnd, "stop": stop, "labels": self.labels_used(),
                "final": self.curve.get(rnd), "workers": self.pool.n_workers}


def _fault_marker() -> str | None:
    """``CONVERGENT_LEARN_FAULT=train``: crash one training worker once (a test hook)."""
    return "fault-train.marker" if os.environ.get("CONVERGENT_LEARN_FAULT") == "train" else None


def run_learning(cfg: ConvergentConfig, run: RunDir, client=None, progress: bool = True) -> dict[str, Any]:
    """Run (or resume) the campaign of ``cfg.learn`` in ``run``; returns its summary and
    writes the report (``<run>/report/learn.md``)."""
    t0 = time.time()
    campaign = Campaign(cfg, run, None, progress)  # builds the pool before the cluster starts

    @contextlib.contextmanager
    def _client():
        if client is not None:
            yield client
        else:
            with dask_client(cfg.cluster, echo=console.print if progress else None,
                             gpu_jobs=cfg.learn.device != "cpu") as c:
                yield c

    with _client() as c:
        # a Slurm pool: a watch per job kind replaces jobs that end early; with the GPU job
        # kind (cluster.gpu, asked for unless learn.device=cpu) GPU tasks go to its jobs
        kinds = job_kinds(c) if client is None else {}
        slurm_gpu = "gpu" in kinds
        gpu = slurm_gpu or (gpu_wanted(cfg.learn.device) and client is None)
        with gpu_worker(c) if gpu and not slurm_gpu else contextlib.nullcontext():
            campaign.pool = Pool(c, Paths(run).timeline, gpu, cpu_resource=slurm_gpu)
            watches = watch_jobs(c, cfg.cluster, campaign.pool.abort) if kinds else []
            try:
                summary = campaign.run()
            finally:
                for watch in watches:
                    watch.stop()
    summary["wall_s"] = time.time() - t0
    summary["report"] = str(build_learn_report(run.path))
    return summary
