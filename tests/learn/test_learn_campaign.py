"""Real active-learning campaigns: real Dask LocalCluster, real tblite, real SIGKILL.

One tiny campaign runs uninterrupted in strict phases (``learn.pipelined=false``, with a
training worker crashed once on purpose); the same campaign, pipelined (the default), is
then killed mid-round with SIGKILL and resumed, and must end with the same dataset keys
(pipelining changes the schedule only), nothing labelled twice. Labelling a batch with a
structure that cannot be computed quarantines it and refills the batch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

SETS = ["cluster.n_workers=2", "model.hidden=16", "model.layers=1", "model.heads=2",
        "simulate.source=g2", "simulate.max_molecules=8", "learn.pool.conformers=3",
        "learn.pool.holdout_per_molecule=1", "learn.rounds=2", "learn.committee=2",
        "learn.label.init=4", "learn.label.batch=3", "learn.label.chunk=1", "learn.label.budget=10",
        "learn.members.first_round_steps=30", "train.steps=15", "learn.explore.trajectories=2",
        "learn.explore.steps=20", "learn.explore.chunk=1", "learn.seed=3"]


def _cmd(run_dir: Path, resume: bool = False) -> list[str]:
    cmd = [sys.executable, "-c", "from convergent.cli import entry; entry()", "learn",
           "--run-dir", str(run_dir)]
    for s in SETS:
        cmd += ["--set", s]
    return cmd + (["--resume"] if resume else [])


def _keys(dataset: Path) -> list[str]:
    from convergent.data.reader import open_dataset

    ds = open_dataset(dataset)
    try:
        return ds.keys()
    finally:
        ds.close()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference campaign, in strict phases; its first training task kills its worker
    once."""
    run = tmp_path_factory.mktemp("learn") / "a"
    env = dict(os.environ, CONVERGENT_LEARN_FAULT="train")
    p = subprocess.run([*_cmd(run), "--set", "learn.pipelined=false"], env=env,
                       capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    return run, p


def test_campaign_labels_with_provenance_and_retries_a_crashed_member(uninterrupted):
    run, proc = uninterrupted
    assert (run / "learn" / "fault-train.marker").exists()  # the crash really happened
    state = json.loads((run / "learn" / "state.json").read_text())
    # the killed worker's running member fails, and any member Dask had already queued on
    # that worker fails with it (allowed_failures 0): one or both are retried, once each
    retries = sum(r["train_retries"] for r in state["rounds"].values())
    assert 1 <= retries <= 2, state["rounds"]
    assert state["stop"] == "label budget" and state["final_round"] == 3
    keys = _keys(run / "data" / "labels")
    assert len(keys) == len(set(keys)) == 4 + 2 * 3
    from convergent.data.reader import open_dataset

    ds = open_dataset(run / "data" / "labels")
    metas = [ds[i]["meta"] for i in range(len(ds))]
    assert sorted(m["round"] for m in metas) == [0] * 4 + [1] * 3 + [2] * 3
    picked = [m for m in metas if m["round"] > 0]
    assert all(m["strategy"] == "uncertainty" and m["score"] > 0 and m["program"] == "tblite"
               for m in picked)
    held_mols = {ds2["molecule_id"] for ds2 in open_dataset(run / "data" / "holdout")}
    assert held_mols and not held_mols & {ds[i]["molecule_id"] for i in range(len(ds))}
    # the committee of every round and the final one were evaluated on the held-out set
    assert sorted(int(k) for k in state["curve"]) == [1, 2, 3]
    assert [state["curve"][k]["labels"] for k in ("1", "2", "3")] == [4, 7, 10]
    # every kind of task ran on the pool and was recorded per worker
    rows = [json.loads(line) for line in (run / "learn" / "timeline.jsonl").read_text().splitlines()]
    spans = [r for r in rows if "start" in r]  # the attempts that ran
    assert {s["kind"] for s in spans} >= {"label", "holdout", "train", "explore", "score", "eval"}
    # the crashed member's attempt is in the timeline too: kind, attempt 0, the failure
    crashed = [r for r in rows if r["failure"] is not None]
    assert crashed and {(r["kind"], r["attempt"]) for r in crashed} == {("train", 0)}, crashed
    assert all("KilledWorker" in r["failure"] for r in crashed)
    assert len({s["worker"] for s in spans}) >= 2 and all(s["end"] >= s["start"] for s in spans)
    sel = json.loads((run / "learn" / "selection-r002.json").read_text())
    assert sel["from_md"] > 0  # round 2 scored frames of the surrogate-driven MD
    # round 2's exploration: one task per trajectory (learn.explore.chunk=1)
    assert sorted(s["name"] for s in spans if s["kind"] == "explore" and s["round"] == 2) == ["t0", "t1"]
    report = (run / "report" / "learn.md").read_text()
    assert "utilisation" in report and "| 2 | 7 | 3 |" in report
    assert (run / "report" / "timeline.png").stat().st_size > 0
    assert (run / "report" / "learning_curve.png").stat().st_size > 0


def test_killed_driver_resumes_to_the_same_dataset(uninterrupted, tmp_path):
    ref, _ = uninterrupted
    run = tmp_path / "b"
    log = run / "learn" / "labels.jsonl"
    proc = subprocess.Popen(_cmd(run), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 300
    killed = False
    try:
        while time.time() < deadline and proc.poll() is None:
            # the driver, mid-way through the labels of round 2, the last (the budget binds:
            # the resumed round must still label its whole batch)
            if log.exists() and any(json.loads(x)["round"] == 2 for x in log.read_text().splitlines() if x):
                os.kill(proc.pid, signal.SIGKILL)
                killed = True
                break
            time.sleep(0.05)
        proc.wait(timeout=30)
    finally:
        try:  # the driver's Dask workers (started by this test's process group)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert killed, "the campaign finished before round 2 was labelled"
    assert proc.returncode == -signal.SIGKILL
    state = json.loads((run / "learn" / "state.json").read_text())
    assert "stop" not in state  # it really was cut short
    p = subprocess.run(_cmd(run, resume=True), capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    keys = _keys(run / "data" / "labels")
    assert len(keys) == len(set(keys))
    logged = [json.loads(x)["key"] for x in log.read_text().splitlines() if x]
    assert len(logged) == len(set(logged)), "a structure was labelled twice"
    assert sorted(keys) == sorted(_keys(ref / "data" / "labels"))  # pipelined == phases
    curve = json.loads((run / "learn" / "state.json").read_text())["curve"]
    ref_curve = json.loads((ref / "learn" / "state.json").read_text())["curve"]
    assert {k: v["labels"] for k, v in curve.items()} == {k: v["labels"] for k, v in ref_curve.items()}


def test_sequential_phases_run_one_after_another(uninterrupted):
    """learn.pipelined=false (the reference campaign): round 0's held-out labels before
    the first committee, each round's exploration after its committee trained."""
    run, _ = uninterrupted
    from convergent.learn.engine import read_timeline

    spans = read_timeline(run / "learn" / "timeline.jsonl")
    first_train = min(s["start"] for s in spans if s["kind"] == "train")
    assert all(s["end"] <= first_train for s in spans if s["kind"] == "holdout")  # round 0 first
    for rnd in (1, 2):  # strict phases: round r's exploration ran after its committee trained
        train_end = max(s["end"] for s in spans if s["kind"] == "train" and s["round"] == rnd)
        assert all(s["start"] >= train_end for s in spans if s["kind"] == "explore" and s["round"] == rnd + 1)


def test_failed_label_is_quarantined_and_the_batch_refilled(tmp_path):
    from ase.build import molecule

    from convergent.cluster.pool import dask_client
    from convergent.learn.engine import Pool
    from convergent.learn.label import label_batch
    from convergent.learn.pool import Candidate
    from convergent.sim.calculators import CalcSpec
    from convergent.sim.config import ClusterConfig

    good = [Candidate.make(n, molecule(n).numbers, molecule(n).positions) for n in ("CH4", "H2O", "NH3")]
    bad = Candidate.make("H2-squashed", [1, 1], np.array([[0, 0, 0], [0.2, 0, 0.0]]))
    ranked = [good[0], bad, good[1], good[2]]
    data = tmp_path / "labels"
    with dask_client(ClusterConfig(n_workers=2, dashboard_address=None)) as client:
        pool = Pool(client, tmp_path / "timeline.jsonl")
        out = label_batch(pool, data, ranked, 2, CalcSpec().to_dict(), rnd=1, strategy="uncertainty",
                          scores={c.key: 1.0 for c in ranked}, chunk=1)
        again = label_batch(pool, data, ranked, 2, CalcSpec().to_dict(), rnd=1, strategy="uncertainty",
                            chunk=1)
    assert out.quarantined == [bad.key] and out.refills == 1
    assert sorted(out.labelled) == sorted([good[0].key, good[1].key])
    assert sorted(_keys(data)) == sorted(out.labelled)  # NH3 was not needed
    assert again.labelled == [] and again.skipped == 3  # nothing is labelled twice
    q = [json.loads(x) for x in (data / "quarantine.jsonl").read_text().splitlines()]
    assert [e["key"] for e in q] == [bad.key] and "apart" in q[0]["reason"]


def test_label_above_the_force_trust_limit_is_quarantined(tmp_path):
    """A squeezed (but not too close) molecule is computed by xTB; its huge forces put it
    in quarantine and the batch is refilled, so it never reaches the training data."""
    from ase.build import molecule

    from convergent.cluster.pool import dask_client
    from convergent.learn.engine import Pool
    from convergent.learn.label import label_batch
    from convergent.learn.pool import Candidate
    from convergent.sim.calculators import CalcSpec
    from convergent.sim.config import ClusterConfig

    good = [Candidate.make(n, molecule(n).numbers, molecule(n).positions) for n in ("CH4", "H2O")]
    squeezed = molecule("H2O")
    squeezed.positions *= 0.62  # O-H 0.6 A: passes min_distance, forces of tens of eV/A
    bad = Candidate.make("H2O-squeezed", squeezed.numbers, squeezed.positions)
    ranked = [bad, good[0], good[1]]
    data = tmp_path / "labels"
    with dask_client(ClusterConfig(n_workers=1, dashboard_address=None)) as client:
        pool = Pool(client, tmp_path / "timeline.jsonl")
        out = label_batch(pool, data, ranked, 2, CalcSpec().to_dict(), rnd=1, strategy="random",
                          chunk=1, max_force=20.0)
    assert out.quarantined == [bad.key] and out.refills == 1
    assert sorted(_keys(data)) == sorted(c.key for c in good)
    q = [json.loads(x) for x in (data / "quarantine.jsonl").read_text().splitlines()]
    assert [e["key"] for e in q] == [bad.key] and "learn.label.max_force=20" in q[0]["reason"]
