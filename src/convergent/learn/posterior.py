"""Last-layer posterior of a committee, for batch selection (``learn.acquisition: posterior``).

Each member's energy per atom is linear in its last hidden layer: ``E/n = w·φ̄ + Σ_Z x_Z
ref_Z + c``, where ``φ̄`` is the per-atom mean of the energy head's penultimate activations
and ``x_Z`` the element fractions. :func:`structure_features` returns, per structure, the
members' ``φ̄`` side by side and the element fractions. :class:`Posterior` is a Bayesian
linear model on those features (standardised columns and an intercept, unit prior,
``ridge`` noise) fitted to the labelled structures: a candidate's posterior variance is
what the labels leave unexplained about it in the committee's own representation (small
for a near-copy of a labelled structure, large for chemistry no label resembles).

Greedy batch selection (:func:`convergent.learn.select.select_batch`) takes the candidate
with the largest ``score ** alpha * gain`` and conditions the posterior on it (a rank-one
update) before the next pick, so one batch does not spend several labels on what one of
them explains. ``gain``: the candidate's own variance (``alpha = 0``: greedy D-optimal
design, MAXDET), or :meth:`Posterior.pool_gain`, how much its label would lower the mean
variance over all candidates — the pool standing in for the structures the surrogate will
be asked about, so a label that informs many candidates beats a lone outlier
(transductive experimental design; Yu, Bi and Tresp, ICML 2006). Last-layer kernels with
posterior updates: Holzmüller et al., "A framework and benchmark for deep batch active
learning for regression", JMLR 2023.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def structure_features(models: Sequence[Any], records: Sequence[Mapping[str, Any]], batch_atoms: int,
                       device: str, elements: Sequence[int]) -> np.ndarray:
    """float64[S, K * h + len(elements)]: each member's per-atom mean of the energy head's
    penultimate activations, then the fraction of each element of ``elements``."""
    n_atoms = np.array([len(r["numbers"]) for r in records], dtype=np.int64)
    parts = [_member_features(m, records, n_atoms, batch_atoms, device) for m in models]
    els = np.asarray(elements, dtype=np.int64)
    frac = np.array([(np.asarray(r["numbers"], np.int64)[:, None] == els).mean(0) if len(r["numbers"])
                     else np.zeros(len(els)) for r in records]).reshape(len(records), len(els))
    return np.concatenate([*parts, frac], axis=1)


def _member_features(model: Any, records: Sequence[Mapping[str, Any]], n_atoms: np.ndarray,
                     batch_atoms: int, device: str) -> np.ndarray:
    """One member's per-structure mean of its energy head's penultimate activations."""
    import torch

    from convergent.models.batching import batches_by_atom_budget, collate_records

    head = model.energy_head
    acts: list[torch.Tensor] = []
    hook = head[len(head) - 2].register_forward_hook(lambda _m, _i, out: acts.append(out.detach()))
    out = np.zeros((len(records), head[len(head) - 1].in_features))
    try:
        for idx in batches_by_atom_budget(n_atoms, batch_atoms):
            rows = np.asarray(idx)
            batch = collate_records([records[i] for i in rows]).to(device)
            acts.clear()
            with torch.no_grad():
                model(batch)
            pooled = np.zeros((len(rows), out.shape[1]))
            np.add.at(pooled, batch.batch.cpu().numpy(), acts[-1].double().cpu().numpy())
            out[rows] = pooled / n_atoms[rows][:, None]
    finally:
        hook.remove()
    return out


class Posterior:
    """Bayesian linear regression on features: prior N(0, I) on the weights of standardised
    columns and of an intercept, observation noise ``ridge``; conditioned on ``labelled``
    rows, then one row at a time (:meth:`condition`). Columns are standardised with the
    mean and spread of ``labelled`` and ``candidates`` together (a constant column is left
    at zero); :meth:`transform` appends the intercept's column of ones."""

    def __init__(self, labelled: np.ndarray, candidates: np.ndarray, ridge: float = 1.0) -> None:
        both = np.concatenate([labelled, candidates]) if len(labelled) else np.asarray(candidates, float)
        width = np.shape(candidates)[1]
        self.mean = both.mean(0) if len(both) else np.zeros(width)
        sd = both.std(0) if len(both) else np.ones(width)
        self.scale = np.divide(1.0, sd, out=np.zeros_like(sd, dtype=float), where=sd > 1e-12)
        self.ridge = float(ridge)
        lab = self.transform(labelled)
        d = lab.shape[1]
        self.cov = np.linalg.inv(lab.T @ lab / self.ridge + np.eye(d))

    def transform(self, x: np.ndarray) -> np.ndarray:
        """Standardised rows of ``x``, with the intercept's 1 appended."""
        z = (np.asarray(x, float) - self.mean) * self.scale
        return np.concatenate([z, np.ones((len(z), 1))], axis=1)

    def variance(self, x: np.ndarray) -> np.ndarray:
        """Posterior variance of the prediction at each (standardised) row of ``x``."""
        return np.sum((x @ self.cov) * x, axis=1)  # einsum's loop is ~8x slower at 2,000 x 263

    def pool_gain(self, x: np.ndarray, pool_second_moment: np.ndarray) -> np.ndarray:
        """Per row of ``x``: how much labelling it would lower the mean posterior variance
        over a pool whose (standardised) rows have second moment ``pool_second_moment``
        (``mean_p p pᵀ``): ``xᵀ P S P x / (ridge + xᵀ P x)``."""
        a = self.cov @ pool_second_moment @ self.cov
        return np.sum((x @ a) * x, axis=1) / (self.ridge + self.variance(x))

    def condition(self, x: np.ndarray) -> None:
        """Observe one more (standardised) row ``x`` (Sherman–Morrison)."""
        px = self.cov @ x
        self.cov -= np.outer(px, px) / (self.ridge + x @ px)
