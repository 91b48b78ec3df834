"""Batch selection: committee-disagreement scores, near-duplicate rule, random baseline.

The score of a candidate is ``E_std / n_atoms + w * max_atoms |F_std|`` (eV/atom and
eV/Å from the committee spread, :mod:`convergent.screen.predict`). ``uncertainty``
takes candidates in decreasing score and skips one that is a near-duplicate of a
structure already in the batch: same atoms and sorted interatomic distances all within
``tol`` Å (a fingerprint invariant to translation, rotation and atom order); with
``labelled_tol`` > 0 it also skips one within ``labelled_tol`` Å of a structure already
labelled (a committee keeps disagreeing on hard chemistry, and without this rule it asks
for near-copies of what it has: on the NCI pool of bench/active_learning.py, 53 of 176
labels went to second or third conformers of a compound). ``random``
draws a seeded random batch (the baseline). ``acquisition="power"`` walks the candidates
in a seeded random order drawn with probability proportional to ``score ** beta``
(without replacement, by the Gumbel-top-k trick) instead of strictly by score, under the
same rules: top-k of a committee's disagreement piles a batch into the few most unusual
compounds, while power sampling keeps most of the preference and spreads the batch
(Kirsch et al., "Stochastic batch acquisition", TMLR 2023). Already labelled or quarantined keys are
never selected.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from convergent.learn.pool import Candidate


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
    strategy: str = "uncertainty",
    tol: float = 0.05,
    seed: int = 0,
    exclude: set[str] | frozenset[str] = frozenset(),
    max_per_molecule: int = 0,
    labelled: Sequence[tuple[np.ndarray, np.ndarray]] = (),
    labelled_tol: float = 0.0,
    acquisition: str = "top",
    beta: float = 1.0,
) -> list[int]:
    """Indices into ``cands`` of the batch, in selection order (at most ``k``);
    ``labelled``: (numbers, positions) of the structures labelled so far."""
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
    elif acquisition != "top":
        raise ValueError(f"unknown acquisition {acquisition!r} (top | power)")
    picked: list[int] = []
    prints: list[tuple[bytes, np.ndarray]] = []
    known: dict[bytes, list[np.ndarray]] = {}  # labelled fingerprints by composition
    for z, pos in (labelled if labelled_tol > 0 else ()):
        atoms, dist = fingerprint(z, pos)
        known.setdefault(atoms, []).append(dist)
    per_mol: Counter[str] = Counter()
    keys: set[str] = set()
    for i in ok:
        if len(picked) >= k:
            break
        c = cands[i]
        if c.key in keys or (max_per_molecule and per_mol[c.molecule_id] >= max_per_molecule):
            continue
        fp = fingerprint(c.numbers, c.positions)
        if tol > 0 and any(near_duplicate(fp, q, tol) for q in prints):
            continue
        if any(near_duplicate(fp, (fp[0], d), labelled_tol) for d in known.get(fp[0], ())):
            continue
        picked.append(i)
        prints.append(fp)
        keys.add(c.key)
        per_mol[c.molecule_id] += 1
    return picked
