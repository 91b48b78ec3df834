"""Helpers of the paged decode attention tests: a random cache and one mixed step, run
through :func:`~convergent.models.llama_paged.paged_attention` with a chosen backend."""

from __future__ import annotations

import random

import torch

from convergent.models.llama import PagedBatch, paged_attention
from convergent.models.paged_meta import StepBuffers


def make_case(seed, dtype, device="cpu", nq=4, nkv=2, hd=16, bs=4, n_dec=9, prefill=True):
    """A cache filled at random and one step: ``n_dec`` decodes (contexts 2..70 tokens,
    tables from a shuffled pool) plus a fresh prompt and a chunk after a cached prefix."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    num_blocks = 200 + 20 * n_dec
    pool = list(range(1, num_blocks))
    rng.shuffle(pool)
    ql, cl, tables, pos, slots = [], [], [], [], []
    lens = [rng.choice([2, 3, bs, bs + 1, 17, 33, 70]) for _ in range(n_dec)]
    kinds = [(1, c) for c in lens] + ([(5, 5), (3, 11)] if prefill else [])
    for q, c in kinds:
        t = [pool.pop() for _ in range(-(-c // bs))]
        ql.append(q)
        cl.append(c)
        tables.append(t)
        for p in range(c - q, c):
            pos.append(p)
            slots.append(t[p // bs] * bs + p % bs)
    shape = (num_blocks * bs, nkv, hd)
    kc = torch.randn(shape, generator=g).to(dtype).to(device)
    vc = torch.randn(shape, generator=g).to(dtype).to(device)
    t = len(pos)
    q = torch.randn(t, nq, hd, generator=g).to(dtype).to(device)
    k = torch.randn(t, nkv, hd, generator=g).to(dtype).to(device)
    v = torch.randn(t, nkv, hd, generator=g).to(dtype).to(device)
    return dict(ql=ql, cl=cl, tables=tables, pos=pos, slots=slots, kc=kc, vc=vc, q=q, k=k, v=v,
                bs=bs, scale=hd**-0.5, n_dec=n_dec)


def run_case(c, backend):
    """paged_attention of the case's step with ``backend``'s decode (caches copied):
    ``(out, batch, k_cache, v_cache)``."""
    dev = c["q"].device
    b = PagedBatch.build(StepBuffers(dev), c["pos"], c["slots"], c["ql"], c["cl"], c["tables"],
                         c["bs"], backend=backend)
    kc, vc = c["kc"].clone(), c["vc"].clone()
    with torch.inference_mode():
        out = paged_attention(c["q"], c["k"], c["v"], b, kc, vc, c["scale"])
    return out, b, kc, vc


def tolerance(dtype, c):
    """Outputs are convex combinations of V rows: in float32 a few float32 ulps of 1; in
    bf16 / fp16 four eps of the dtype at max |v| (the probabilities are rounded to the
    dtype before the PV product, and the output once more)."""
    if dtype == torch.float32:
        return 1e-5
    return 4 * torch.finfo(dtype).eps * float(c["vc"].abs().max().float())
