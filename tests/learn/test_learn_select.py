"""Selection rules of active learning: content keys, near-duplicates, ranking, random draw."""

from __future__ import annotations

import numpy as np
import pytest

from convergent.learn.pool import (
    Candidate,
    content_key,
    is_holdout,
    load_candidates,
    save_candidates,
)
from convergent.learn.select import combined_score, fingerprint, near_duplicate
from tests.learn.picking import pick

WATER = (np.array([8, 1, 1]), np.array([[0.0, 0.0, 0.0], [0.96, 0.0, 0.0], [-0.24, 0.93, 0.0]]))




def _rot(pos: np.ndarray, angle: float) -> np.ndarray:
    c, s = np.cos(angle), np.sin(angle)
    return pos @ np.array([[c, -s, 0], [s, c, 0], [0, 0, 1.0]]).T + np.array([1.0, -2.0, 0.5])


def test_content_key_is_the_structure_itself():
    z, pos = WATER
    assert content_key(z, pos) == content_key(z.copy(), pos + 1e-8)  # below the rounding
    assert content_key(z, pos) != content_key(z, pos + np.array([0.01, 0, 0]))
    assert content_key(z, pos) != content_key(z, pos, charge=1)
    a = Candidate.make("w", z, pos, origin="pool")
    b = Candidate.make("other-id", z, pos, origin="md")  # same structure, other origin
    assert a.key == b.key


def test_fingerprint_ignores_rotation_translation_and_atom_order():
    z, pos = WATER
    moved = _rot(pos, 0.7)[[2, 0, 1]]
    assert near_duplicate(fingerprint(z, pos), fingerprint(z[[2, 0, 1]], moved), 1e-6)
    stretched = pos.copy()
    stretched[1, 0] += 0.2
    assert not near_duplicate(fingerprint(z, pos), fingerprint(z, stretched), 0.05)
    assert near_duplicate(fingerprint(z, pos), fingerprint(z, stretched), 0.25)
    assert not near_duplicate(fingerprint(z, pos), fingerprint(np.array([8, 1, 9]), pos), 10.0)


def _cands():
    z, pos = WATER
    out = [Candidate.make("w", z, pos), Candidate.make("w", z, _rot(pos, 1.0) + 1e-3)]  # near-dups
    for k in range(1, 5):
        p = pos.copy()
        p[1, 0] += 0.1 * k
        out.append(Candidate.make(f"w{k}", z, p))
    return out


def test_uncertainty_takes_highest_scores_but_no_near_duplicates():
    cands = _cands()
    scores = np.array([9.0, 8.0, 1.0, 2.0, 3.0, np.nan])
    picked = pick(cands, scores, 3, "uncertainty", tol=0.05)
    assert picked == [0, 4, 3]  # 1 is a rotated copy of 0; NaN is never picked
    assert pick(cands, scores, 3, "uncertainty", tol=0.0) == [0, 1, 4]  # rule off
    assert pick(cands, scores, 2, "uncertainty", exclude={cands[0].key}) == [1, 4]
    assert pick(cands, scores, 9, "uncertainty", tol=0.0, max_per_molecule=1) == [0, 4, 3, 2]


def test_random_is_seeded_and_ignores_scores():
    cands = _cands()
    a = pick(cands, np.zeros(6), 3, "random", seed=5)
    assert a == pick(cands, np.ones(6), 3, "random", seed=5)
    assert len(set(a)) == 3
    draws = {tuple(pick(cands, np.zeros(6), 3, "random", seed=s)) for s in range(8)}
    assert len(draws) > 1
    with pytest.raises(ValueError, match="strategy"):
        pick(cands, np.zeros(6), 3, "greedy")


def test_score_combines_energy_per_atom_and_force_spread():
    s = combined_score(np.array([0.3, np.nan]), np.array([0.5, 0.1]), np.array([3, 3]), 2.0)
    assert s[0] == pytest.approx(0.1 + 1.0) and np.isnan(s[1])


def test_candidates_round_trip_and_holdout_split_is_stable(tmp_path):
    cands = _cands()
    save_candidates(tmp_path / "c.npz", cands)
    back = load_candidates(tmp_path / "c.npz")
    assert [c.key for c in back] == [c.key for c in cands]
    assert all(np.array_equal(a.positions, b.positions) for a, b in zip(back, cands, strict=True))
    ids = [f"m{i}" for i in range(400)]
    held = [i for i in ids if is_holdout(i, 0.25, 3)]
    assert 60 < len(held) < 140 and held == [i for i in ids if is_holdout(i, 0.25, 3)]


def test_uncertainty_skips_near_copies_of_labelled_structures():
    z, pos = WATER
    copy = pos + np.array([[0.03, 0.0, 0.0], [0.0, 0.02, 0.0], [0.0, 0.0, 0.0]])  # a rattled conformer
    other = pos.copy()
    other[1, 0] += 0.5  # far from the labelled one
    cands = [Candidate.make("w", z, copy), Candidate.make("w2", z, other),
             Candidate.make("w3", z, other + np.array([[0.0, 0.0, 0.0], [0.3, 0.0, 0.0], [0.0, 0.0, 0.0]]))]
    scores = np.array([0.9, 0.5, 0.1])
    labelled = [(z, pos)]
    assert pick(cands, scores, 2, tol=0.0) == [0, 1]  # the rule off: the copy first
    assert pick(cands, scores, 2, tol=0.0, labelled=labelled, labelled_tol=0.1) == [1, 2]
    assert pick(cands, scores, 2, tol=0.0, labelled=labelled, labelled_tol=0.0) == [0, 1]
    # random ignores the rule (it is the baseline)
    assert len(pick(cands, scores, 3, "random", labelled=labelled, labelled_tol=0.1)) == 3


def test_power_acquisition_is_seeded_prefers_high_scores_and_keeps_the_rules():
    z, pos = WATER
    cands = [Candidate.make(f"m{i}", z, pos + np.array([[0.0, 0.0, 0.0], [0.3 * i, 0.0, 0.0], [0.0, 0.0, 0.0]]))
             for i in range(6)]
    scores = np.array([1e-6, 1e-6, 1e-6, 1e-6, 1.0, 0.0])
    a = pick(cands, scores, 3, tol=0.0, seed=4, acquisition="power")
    assert a == pick(cands, scores, 3, tol=0.0, seed=4, acquisition="power")  # seeded
    assert a[0] == 4 and 5 not in a  # a million times likelier first; a zero score last
    draws = {tuple(pick(cands, scores, 3, tol=0.0, seed=s, acquisition="power")) for s in range(8)}
    assert len(draws) > 1  # not top-k in disguise
    flat = np.ones(6)
    assert set(pick(cands, flat, 6, tol=0.0, seed=1, acquisition="power")) == set(range(6))
    # the rules still hold: candidate 4's copy is a near-duplicate and never joins it
    dup = [*cands, Candidate.make("m4-copy", z, cands[4].positions + 1e-3)]
    picked = pick(dup, np.append(scores, 1.0), 7, tol=0.05, seed=2, acquisition="power")
    assert not ({4, 6} <= set(picked))
    with pytest.raises(ValueError, match="acquisition"):
        pick(cands, scores, 3, acquisition="greedy")


def test_posterior_variance_is_what_the_labels_leave_unexplained():
    from convergent.learn.posterior import Posterior

    rng = np.random.default_rng(0)
    lab = rng.normal(size=(40, 3)) * np.array([1.0, 1.0, 0.0])  # labels span two directions only
    cand = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    post = Posterior(lab, np.concatenate([cand, [[0.0, 0.0, -1.0]]]), ridge=1.0)
    x = post.transform(cand)
    v = post.variance(x)
    assert v[1] > 10 * v[0]  # the unseen direction keeps its prior variance
    post.condition(x[1])
    after = post.variance(x)
    assert after[1] < 0.6 * v[1] and after[0] <= v[0] + 1e-12  # an observation only removes variance


def test_posterior_acquisition_spreads_a_batch_over_feature_space_and_keeps_the_rules():
    z, pos = WATER
    cands = [Candidate.make(f"m{i}", z, pos + np.array([[0.0, 0.0, 0.0], [0.3 * i, 0.0, 0.0], [0.0, 0.0, 0.0]]))
             for i in range(6)]
    # candidates 0-2 nearly one point of feature space, 3-5 another; 0-2 have the larger spread
    feats = np.array([[1.0, 0.0], [1.0, 0.01], [1.01, 0.0], [0.0, 1.0], [0.0, 1.01], [0.01, 1.0]])
    labelled = np.zeros((0, 2))
    scores = np.array([1.0, 0.99, 0.98, 0.5, 0.5, 0.5])
    top = pick(cands, scores, 2, tol=0.0)
    post = pick(cands, scores, 2, tol=0.0, acquisition="posterior", features=(feats, labelled))
    assert top == [0, 1]  # top-k spends both labels on one region
    assert post[0] == 0 and post[1] in (3, 4, 5)  # the posterior knows 1 is explained by 0
    # alpha = 0: the scores do not matter, only what the labels leave unexplained
    labelled = np.array([[1.0, 0.0], [1.0, 0.005]] * 5)
    pure = pick(cands, scores, 1, tol=0.0, acquisition="posterior", features=(feats, labelled), alpha=0.0)
    assert pure[0] in (3, 4, 5)
    # the rules hold: one structure per molecule
    same = [Candidate.make("one", c.numbers, c.positions) for c in cands]
    assert len(pick(same, scores, 3, tol=0.0, max_per_molecule=1, acquisition="posterior",
                            features=(feats, np.zeros((0, 2))))) == 1
    with pytest.raises(ValueError, match="features"):
        pick(cands, scores, 2, acquisition="posterior")


def test_pool_gain_prefers_what_informs_many_candidates_over_a_lone_outlier():
    z, pos = WATER
    cands = [Candidate.make(f"m{i}", z, pos + np.array([[0.0, 0.0, 0.0], [0.05 * i, 0.0, 0.0], [0.0, 0.0, 0.0]]))
             for i in range(13)]
    # twelve candidates in one dense cluster, one outlier
    rng = np.random.default_rng(1)
    feats = np.concatenate([np.array([0.0, 1.0, 0.0]) + 0.3 * rng.normal(size=(12, 3)), [[2.0, 0.0, 0.0]]])
    lab = np.array([[0.0, 0.0, 0.0], [0.1, 0.0, 0.0]])
    flat = np.ones(13)
    var = pick(cands, flat, 1, tol=0.0, acquisition="posterior", features=(feats, lab), alpha=0.0)
    pool = pick(cands, flat, 1, tol=0.0, acquisition="posterior", features=(feats, lab), alpha=0.0,
                        gain="pool")
    assert var == [12]  # the outlier has the largest variance of its own
    assert pool[0] < 12  # one of the cluster lowers the variance of twelve candidates
    with pytest.raises(ValueError, match="gain"):
        pick(cands, flat, 1, acquisition="posterior", features=(feats, lab), gain="other")
