"""Issue 37: learn's initial labels hold every element of the pool and the held-out set."""

from __future__ import annotations

import numpy as np
import pytest
from ase.build import molecule

from convergent.core.errors import InputError
from convergent.learn.loop import _seed
from convergent.learn.pool import Candidate, cover_elements


def _cands(names: list[str], copies: int = 3) -> list[Candidate]:
    out = []
    for name in names:
        for k in range(copies):
            a = molecule(name)
            a.rattle(0.02, seed=k)
            out.append(Candidate.make(name, a.numbers, a.positions))
    return out


def _ranked(cands: list[Candidate], seed: int) -> list[Candidate]:
    rng = np.random.default_rng(_seed("init", seed))  # as Campaign.start
    return [cands[i] for i in rng.permutation(len(cands))]


def test_initial_labels_cover_every_element_deterministically():
    # mostly H/C/O; Cl and F only in one molecule each, N only in the held-out set's NH3
    # and the pool's CH3CN
    pool = _cands(["CH4", "H2O", "CH3OH", "C2H6", "H2CO", "C2H4", "CH3CN"] * 3 + ["CH3Cl", "CF4"])
    held = _cands(["NH3", "C2H6"])
    for seed in range(5):
        first = cover_elements(_ranked(pool, seed), held, k=6)[:6]
        have = {int(z) for c in first for z in c.numbers}
        assert have == {1, 6, 7, 8, 9, 17}, seed
        assert [c.key for c in cover_elements(_ranked(pool, seed), held, 6)] == \
            [c.key for c in cover_elements(_ranked(pool, seed), held, 6)]
    # the plain seeded order alone would not: the first 6 of seed 0 lack Cl or F
    plain = {int(z) for c in _ranked(pool, 0)[:6] for z in c.numbers}
    assert not {9, 17} <= plain
    # every pool structure is still there, once
    out = cover_elements(_ranked(pool, 0), held, 6)
    assert sorted(c.key for c in out) == sorted(c.key for c in pool)


def test_refuses_an_element_only_in_the_held_out_set_or_too_few_labels():
    pool = _cands(["CH4", "H2O"])
    with pytest.raises(InputError, match=r"element Cl \(Z=17\) is in the held-out structure CH3Cl"):
        cover_elements(pool, _cands(["CH3Cl"]), k=10)
    pool = _cands(["CH4", "H2O", "NH3", "CH3Cl"])
    with pytest.raises(InputError, match="learn.label.init=2 cannot cover"):
        cover_elements(pool, [], k=2)
