"""Batch selection: committee-disagreement scores, near-duplicate rule, random baseline.

The score of a candidate is ``E_std / n_atoms + w * max_atoms |F_std|`` (eV/atom and
eV/Å from the committee spread, :mod:`convergent.screen.predict`). ``uncertainty``
takes candidates in decreasing score and skips one that is a near-duplicate of a
structure already in the batch: same atoms and sorted interatomic distances all within
``tol`` Å (a fingerprint invariant to translation, rotation and atom order); with
``labelled_tol`` > 0 it also skips one within ``labelled_tol`` Å of a structure already
labelled (a committee keeps disagreeing on hard chemistry, and without this rule it asks
for near-copies of what it has: on the NCI pool of bench/learn/active_learning.py, 53 of 176
labels went to second or third conformers of a compound). ``random``
draws a seeded random batch (the baseline). ``acquisition="power"`` walks the candidates
in a seeded random order drawn with probability proportional to ``score ** beta``
(without replacement, by the Gumbel-top-k trick) instead of strictly by score, under the
same rules: top-k of a committee's disagreement piles a batch into the few most unusual
compounds, while power sampling keeps most of the preference and spreads the batch
(Kirsch et al., "Stochastic batch acquisition", TMLR 2023). ``acquisition="posterior"``
picks greedily by ``score ** alpha`` times a gain under the committee's last-layer
posterior (:mod:`convergent.learn.posterior`: the candidate's own variance, or how much its
label lowers the mean variance over all candidates), conditioning that posterior on each
pick, under the same rules. Already labelled or quarantined keys are never selected.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from convergent.learn.config import SelectConfig
from convergent.learn.pool import Candidate
from convergent.learn.posterior import Posterior


def fingerprint(numbers: np.ndarray, positions: np.ndarray) -> tuple[bytes, np.ndarray]:
    """(sorted atomic numbers, sorted pairwise distances in Å)."""
    pos = np.asarray(positions, dtype=np.float64)
    d = np.sqrt(((pos[:, None, :] - pos[None, :, :]) ** 2).sum(-1))
    iu = np.triu_indices(len(pos), k=1)
    return np.sort(np.asarray(numbers, np.int64)).tobytes(), np.sort(d[iu])


def near_duplicate(a: tuple[bytes, np.ndarray], b: tuple[bytes, np.ndarray], tol: float) -> bool:
    """True if two fingerprints have the same atoms and every sorted distance within ``tol``."""
    if a[0] != b[0] or a[1].shape != b[1].shape:
        return False
    return bool(a[1].size == 0 or np.abs(a[1] - b[1]).max() <= tol)


def combined_score(energy_std: np.ndarray, force_std_max: np.ndarray, n_atoms: np.ndarray,
                   force_weight: float) -> np.ndarray:
    """``energy_std / n_atoms + force_weight * force_std_max`` (NaN where either is NaN)."""
    return (np.asarray(energy_std, float) / np.maximum(np.asarray(n_atoms, float), 1.0)
            + force_weight * np.asarray(force_std_max, float))


def select_batch(
    cands: Sequence[Candidate],
    scores: np.ndarray,
    k: int,
    sel: SelectConfig,
    *,
    seed: int = 0,
    exclude: set[str] | frozenset[str] = frozenset(),
    labelled: Sequence[tuple[np.ndarray, np.ndarray]] = (),
    features: tuple[np.ndarray, np.ndarray] | None = None,
) -> list[int]:
    """Indices into ``cands`` of the batch, in selection order (at most ``k``), by the
    rules of ``sel`` (``learn.select``); ``labelled``: (numbers, positions) of the
    structures labelled so far; ``features``: (candidates' rows, labelled structures' rows)
    of :func:`convergent.learn.posterior.structure_features` (``acquisition="posterior"``)."""
    strategy, tol, max_per_molecule = sel.strategy, sel.diversity_tol, sel.max_per_molecule
    labelled_tol, acquisition, beta = sel.labelled_tol, sel.acquisition, sel.power_beta
    alpha, ridge, gain = sel.posterior_alpha, sel.posterior_ridge, sel.posterior_gain
    ok = [i for i, c in enumerate(cands) if c.key not in exclude]
    if strategy == "random":
        rng = np.random.default_rng(seed)
        order = [ok[j] for j in rng.permutation(len(ok))]
        seen: set[str] = set()
        picked = []
        for i in order:
            if cands[i].key not in seen:
                seen.add(cands[i].key)
                picked.append(i)
            if len(picked) >= k:
                break
        return picked
    if strategy != "uncertainty":
        raise ValueError(f"unknown selection strategy {strategy!r} (uncertainty | random)")
    s = np.asarray(scores, dtype=np.float64)
    ok = [i for i in ok if np.isfinite(s[i])]
    ok.sort(key=lambda i: (-s[i], cands[i].key))  # ties: by key, so the order is reproducible
    if acquisition == "power" and ok:
        gumbel = np.random.default_rng(seed).gumbel(size=len(ok))
        with np.errstate(divide="ignore"):
            keys = beta * np.log(np.maximum(s[ok], 0.0)) + gumbel
        ok = [ok[j] for j in np.argsort(-keys, kind="stable")]
    elif acquisition not in ("top", "posterior"):
        raise ValueError(f"unknown acquisition {acquisition!r} (top | power | posterior)")
    rule = _Rules(cands, k, tol, max_per_molecule, labelled if labelled_tol > 0 else (), labelled_tol)
    if acquisition == "posterior":
        if features is None:
            raise ValueError("acquisition 'posterior' needs the candidates' and labelled features")
        return _greedy_posterior(ok, s, features, alpha, ridge, gain, rule)
    for i in ok:
        if rule.full():
            break
        rule.offer(i)
    return rule.picked


def _greedy_posterior(ok: list[int], s: np.ndarray, features: tuple[np.ndarray, np.ndarray],
                      alpha: float, ridge: float, gain: str, rule: _Rules) -> list[int]:
    """The largest ``s ** alpha * gain`` first, the posterior conditioned on each pick (a
    candidate the rules refuse is dropped without conditioning). ``gain``: ``variance``
    (the candidate's own posterior variance) or ``pool`` (how much its label would lower
    the mean posterior variance over all candidates)."""
    if gain not in ("variance", "pool"):
        raise ValueError(f"unknown posterior gain {gain!r} (variance | pool)")
    cand_x, lab_x = features
    post = Posterior(lab_x, cand_x, ridge)
    x = post.transform(cand_x[ok])
    moment = x.T @ x / max(len(x), 1)
    weight = np.maximum(s[ok], 0.0) ** alpha

    def value() -> np.ndarray:
        return weight * (post.pool_gain(x, moment) if gain == "pool" else post.variance(x))

    alive = np.ones(len(ok), bool)
    g = value()
    while not rule.full() and alive.any():
        j = int(np.argmax(np.where(alive, g, -np.inf)))
        alive[j] = False
        if rule.offer(ok[j]):
            post.condition(x[j])
            g = value()
    return rule.picked


class _Rules:
    """The batch so far and the rules a candidate must pass to join it: a new key, at most
    ``max_per_molecule`` per molecule, no near-duplicate within the batch (``tol``) or of a
    labelled structure (``labelled_tol``)."""

    def __init__(self, cands: Sequence[Candidate], k: int, tol: float, max_per_molecule: int,
                 labelled: Sequence[tuple[np.ndarray, np.ndarray]], labelled_tol: float) -> None:
        self.cands, self.k, self.tol, self.max_per_molecule = cands, k, tol, max_per_molecule
        self.labelled_tol = labelled_tol
        self.picked: list[int] = []
        self.prints: list[tuple[bytes, np.ndarray]] = []
        self.known: dict[bytes, list[np.ndarray]] = {}  # labelled fingerprints by composition
        for z, pos in labelled:
            atoms, dist = fingerprint(z, pos)
            self.known.setdefault(atoms, []).append(dist)
        self.per_mol: Counter[str] = Counter()
        self.keys: set[str] = set()

    def full(self) -> bool:
        return len(self.picked) >= self.k

    def offer(self, i: int) -> bool:
        """Add candidate ``i`` to the batch if it passes the rules; whether it did."""
        c = self.cands[i]
        if c.key in self.keys or (self.max_per_molecule and self.per_mol[c.molecule_id] >= self.max_per_molecule):
            return False
        fp = fingerprint(c.numbers, c.positions)
        if self.tol > 0 and any(near_duplicate(fp, q, self.tol) for q in self.prints):
            return False
        if any(near_duplicate(fp, (fp[0], d), self.labelled_tol) for d in self.known.get(fp[0], ())):
            return False
        self.picked.append(i)
        self.prints.append(fp)
        self.keys.add(c.key)
        self.per_mol[c.molecule_id] += 1
        return True

