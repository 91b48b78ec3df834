"""The device sampler: batched top-k / top-p equal the per-row reference, seeded draws
are reproducible and independent of the batch, greedy rows are the argmax, and the
Gumbel-max draw samples the filtered distribution."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from convergent.serve.sampling import (  # noqa: E402
    RowParams,
    SamplingParams,
    filter_logits,
    filter_rows,
    row_logprobs,
    sample_device,
    sample_rows,
    seeded_gumbel,
)


def _rows(params: list[tuple[SamplingParams, int]]) -> RowParams:
    rows = RowParams()
    for p, pos in params:
        rows.add(p, pos)
    return rows


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.7), (7, 0.5), (1, 0.9),
                                         (200, 0.95)])
def test_batched_filters_equal_the_per_row_reference(top_k, top_p):
    g = torch.Generator().manual_seed(top_k)
    x = torch.randn(6, 97, generator=g) * 3
    x[2, :10] = x[2, 0]  # ties
    k = torch.full((6,), top_k)
    p = torch.full((6,), top_p, dtype=torch.float64)
    got = filter_rows(x, k, p, use_top_p=top_p < 1)
    for i in range(6):
        want = filter_logits(x[i], 1.0, top_k, top_p)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), i
        assert torch.equal(got[i], want), i


def test_mixed_rows_each_get_their_own_filter():
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    k = torch.tensor([3, 0, 10])
    p = torch.tensor([1.0, 0.6, 0.8], dtype=torch.float64)
    got = filter_rows(x, k, p)
    for i, (kk, pp) in enumerate([(3, 1.0), (0, 0.6), (10, 0.8)]):
        assert torch.equal(got[i], filter_logits(x[i], 1.0, kk, pp))


def test_seeded_draws_are_reproducible_and_batch_independent():
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    ps = [(SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=s), 10 + s) for s in range(5)]
    a = sample_rows(logits, _rows(ps))
    assert a == sample_rows(logits, _rows(ps))  # the same seeds: the same tokens
    perm = [3, 0, 4, 1, 2]  # another batch order
    b = sample_rows(logits[perm], _rows([ps[i] for i in perm]))
    assert [a[i] for i in perm] == b
    alone = [sample_rows(logits[i : i + 1], _rows([ps[i]]))[0] for i in range(5)]
    assert alone == a  # a row alone draws what it drew in the batch
    other = sample_rows(logits, _rows([(SamplingParams(temperature=0.8, seed=99), 10)] * 5))
    assert other != a


def test_greedy_rows_are_the_argmax_beside_drawn_rows():
    logits = torch.randn(4, 33, generator=torch.Generator().manual_seed(3))
    ps = [(SamplingParams(), 1), (SamplingParams(temperature=1.0, seed=1), 1),
          (SamplingParams(), 1), (SamplingParams(temperature=0.5, top_k=1, seed=4), 1)]
    toks = sample_device(logits, _rows(ps))
    assert toks.dtype == torch.int64 and toks.device == logits.device
    am = logits.argmax(-1).tolist()
    assert toks[0] == am[0] and toks[2] == am[2]
    assert toks[3] == am[3]  # top-k 1 is greedy


def test_gumbel_race_samples_the_distribution():
    """Token frequencies over many seeds match the softmax within 5 sigma (binomial)."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    logits = probs.log()
    n = 20000
    noise = seeded_gumbel(torch.arange(n, dtype=torch.int64) * 1_000_003 + 7, 5)
    toks = (logits[None, :] + noise).argmax(-1)
    counts = torch.bincount(toks, minlength=5).double() / n
    for q, f in zip(probs.tolist(), counts.tolist(), strict=True):
        assert abs(f - q) < 5 * math.sqrt(q * (1 - q) / n), (q, f)
    u = seeded_gumbel(torch.tensor([5, 5, 6]), 1000)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])


def test_top_p_and_top_k_draw_only_inside_the_filter():
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(5))
    allowed = set(torch.topk(logits[0], 4).indices.tolist())
    for s in range(50):
        t = sample_rows(logits, _rows([(SamplingParams(temperature=2.0, top_k=4, seed=s), 3)]))
        assert t[0] in allowed


def test_row_logprobs_on_the_device_equal_log_softmax():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(6))
    rows = _rows([(SamplingParams(logprobs=2), 1), (SamplingParams(), 1),
                  (SamplingParams(logprobs=0), 1)])
    toks = sample_rows(logits, rows)
    info = row_logprobs(logits, toks, rows)
    lp = torch.log_softmax(logits, -1)
    assert info[1] is None
    assert info[0].logprob == pytest.approx(float(lp[0, toks[0]]), abs=1e-6)
    v, ix = torch.topk(lp[0], 2)
    assert list(info[0].top) == ix.tolist()
    assert list(info[0].top.values()) == pytest.approx(v.tolist(), abs=1e-6)
    assert info[2].top == {} and info[2].logprob == pytest.approx(float(lp[2, toks[2]]), abs=1e-6)
