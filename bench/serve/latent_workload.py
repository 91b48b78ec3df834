"""Serving workloads whose output lengths are *not* determined by what the prompt shows.

In :func:`convergent.serve.workload.make_trace` the prompt names a task kind picked from a
noisy copy of the output length, so a length predictor that reads the prompt is partly
right by construction. Here the output length is driven by hidden variables the
predictor never sees, and the prompt reflects them only weakly:

* family ``"A"`` (fit/calibrate on this one) — each request comes from a hidden *user*
  with a persistent verbosity ``v ~ N(0, 1)``; the task kind named in the prompt is picked
  from ``0.5 v + N(0, 1)`` (correlation ~0.45 with ``v``); the output length is
  log-normal in ``v`` (``log L = 5.83 + 0.9 v + 0.4 kind_score``) times a heavy-tailed
  Student-t (3 degrees of freedom) factor, capped at 1024. The prompt length is
  independent of everything.
* family ``"B"`` (held out: another family and other parameters) — a hidden *mode*
  (terse with probability 0.7, elaborate otherwise); the prompt's kind depends on the mode
  only through a mild shift of the kind prior; terse answers are Gamma(2, 60) tokens,
  elaborate ones Pareto(alpha 1.4, from 150 tokens); and, unlike A, a longer prompt makes
  a somewhat longer answer (x ``(input_len / 60) ** 0.25``). Capped at 1024.

A predictor is fitted on A and reported on a fresh A sample *and* on B
(``bench/serve/throughput.py``); :func:`kind_ceiling_mae` gives the error of the best
predictor that knows only the prompt's kind (fitted in-sample: an optimistic reference
for what any prompt-reading predictor can reach).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from convergent.serve.workload import OUTPUT_CAP, TASK_KINDS, TraceRequest, requests_from

__all__ = ["FAMILIES", "kind_ceiling_mae", "make_latent_trace"]

FAMILIES = ("A", "B")
INPUT_MU, INPUT_SIGMA = 4.19, 1.20  # the ShareGPT input fit, as in workload.py


def _kinds_from_score(score: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Equal-probability bins of a standardised score -> kind indices (short to long)."""
    k = len(TASK_KINDS)
    edges = np.quantile(rng.normal(0, 1, 20000), np.linspace(0, 1, k + 1)[1:-1])
    return np.searchsorted(edges, score)


def _family_a(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n_users = max(8, n // 10)
    user_v = rng.normal(0, 1, n_users)
    users = rng.integers(0, n_users, n)
    v = user_v[users]
    score = (0.5 * v + rng.normal(0, 1, n)) / math.sqrt(1.25)
    kinds = _kinds_from_score(score, rng)
    kind_score = (kinds - (len(TASK_KINDS) - 1) / 2) / (len(TASK_KINDS) / 2)  # ~[-1, 1]
    heavy = rng.standard_t(3, n) * 0.35
    out = np.exp(5.83 + 0.9 * v + 0.4 * kind_score + heavy)
    inp = np.exp(rng.normal(INPUT_MU, INPUT_SIGMA, n))
    return inp, out, kinds


def _family_b(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    elaborate = rng.random(n) < 0.3
    k = len(TASK_KINDS)
    # kind prior: mildly tilted towards the long kinds for the elaborate mode
    base = np.ones(k) / k
    tilt = np.linspace(-1, 1, k)
    p_terse = base * np.exp(-0.25 * tilt)
    p_elab = base * np.exp(0.5 * tilt)
    p_terse, p_elab = p_terse / p_terse.sum(), p_elab / p_elab.sum()
    kinds = np.where(
        elaborate, rng.choice(k, n, p=p_elab), rng.choice(k, n, p=p_terse)
    )
    inp = np.exp(rng.normal(INPUT_MU + 0.2, INPUT_SIGMA * 0.8, n))
    terse = rng.gamma(2.0, 60.0, n)
    pareto = 150.0 * (1.0 + rng.pareto(1.4, n))
    out = np.where(elaborate, pareto, terse) * (np.clip(inp, 4, None) / 60.0) ** 0.25
    return inp, out, kinds


def make_latent_trace(
    n: int,
    seed: int = 0,
    family: str = "A",
    max_input: int = 1024,
    output_cap: int = OUTPUT_CAP,
) -> list[TraceRequest]:
    """``n`` requests of workload ``family`` (``"A"`` or ``"B"``), reproducible by seed.

    Input lengths are clipped to ``[4, max_input]`` tokens (byte tokenizer + BOS), outputs
    to ``[1, output_cap]``; the prompt is the kind's phrasing plus filler words.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown workload family {family!r} ({', '.join(FAMILIES)})")
    rng = np.random.default_rng([seed, FAMILIES.index(family)])
    inp, out, kinds = (_family_a if family == "A" else _family_b)(n, rng)
    inp = np.clip(np.round(inp), 4, max_input).astype(int)
    out = np.clip(np.round(out), 1, output_cap).astype(int)
    return requests_from(rng, kinds, inp, out)


def kind_ceiling_mae(trace: Sequence[TraceRequest]) -> float:
    """MAE (tokens) of predicting each request's output by the median of its kind, the
    medians taken on ``trace`` itself: what knowing the prompt's kind alone can reach."""
    by_kind: dict[str, list[int]] = {}
    for r in trace:
        by_kind.setdefault(r.kind, []).append(r.output_len)
    med = {k: float(np.median(v)) for k, v in by_kind.items()}
    return float(np.mean([abs(med[r.kind] - r.output_len) for r in trace]))
