"""select_batch with the rules of a ``learn.select`` section built from keyword values
(the tests' shorthand for one selection rule at a time)."""

from __future__ import annotations

from convergent.learn.config import SelectConfig
from convergent.learn.select import select_batch


def pick(cands, scores, k, strategy="uncertainty", tol=0.05, seed=0, exclude=frozenset(),
         max_per_molecule=0, labelled=(), labelled_tol=0.0, acquisition="top", beta=1.0,
         features=None, alpha=1.0, ridge=1.0, gain="variance"):
    """The batch ``select_batch`` picks under these rules (defaults: top by score)."""
    sel = SelectConfig(strategy=strategy, diversity_tol=tol, max_per_molecule=max_per_molecule,
                       labelled_tol=labelled_tol, acquisition=acquisition, power_beta=beta,
                       posterior_alpha=alpha, posterior_ridge=ridge, posterior_gain=gain)
    return select_batch(cands, scores, k, sel, seed=seed, exclude=exclude, labelled=labelled,
                        features=features)
