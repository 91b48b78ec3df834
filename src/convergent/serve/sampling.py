"""Token sampling on the last stage: greedy, temperature, top-k, top-p, per-row seeds,
and log-probabilities of the chosen and the most likely tokens.

The order of the filters is that of transformers' ``generate``: temperature, then top-k,
then top-p (the nucleus keeps the smallest set whose probability reaches ``top_p``, at
least one token). Each sampled row draws from its own ``torch.Generator`` seeded with the
request's seed and the token's position, so a request's tokens do not depend on the
batch it happened to share. Log-probabilities are those of the model's raw distribution
(``log_softmax`` of the logits, before temperature and filters), as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RowParams", "filter_logits", "sample_rows"]


@dataclass
class RowParams:
    """Sampling settings of the rows of one micro-batch (plain lists: cheap to pickle)."""

    temperatures: list[float] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    top_ks: list[int] = field(default_factory=list)  # <= 0: off
    top_ps: list[float] = field(default_factory=list)  # 1.0: off
    logprobs: list[int] = field(default_factory=list)  # -1: none; k: chosen + top k


def filter_logits(logits, temperature: float, top_k: int, top_p: float):
    """One row's logits [V] scaled by ``temperature`` with top-k / top-p applied (-inf)."""
    import torch

    x = logits / temperature
    if 0 < top_k < x.numel():
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        srt, idx = torch.sort(x, descending=False)
        cum = torch.softmax(srt, -1).cumsum(-1)
        drop = cum <= (1 - top_p)
        drop[-1] = False  # keep at least the most likely token
        x = x.masked_fill(drop.scatter(0, idx, drop), float("-inf"))
    return x


def sample_rows(logits, p: RowParams) -> tuple[list[int], list[tuple | None]]:
    """Sampled token per row of ``logits`` [R, V] (float32) and, where asked, its logprob
    info ``(logprob, [(token, logprob), ...top k])``."""
    import torch

    toks = logits.argmax(-1).tolist()
    n = len(toks)
    temps = p.temperatures or [0.0] * n
    for i, t in enumerate(temps):
        if t and t > 0:
            k = p.top_ks[i] if p.top_ks else 0
            tp = p.top_ps[i] if p.top_ps else 1.0
            x = filter_logits(logits[i].cpu(), t, k, tp)
            g = torch.Generator().manual_seed(p.seeds[i] & 0x7FFFFFFFFFFF)
            toks[i] = int(torch.multinomial(torch.softmax(x, -1), 1, generator=g))
    info: list[tuple | None] = [None] * n
    if p.logprobs and any(k >= 0 for k in p.logprobs):
        lp = torch.log_softmax(logits, -1).cpu()
        for i, k in enumerate(p.logprobs):
            if k < 0:
                continue
            top = []
            if k > 0:
                v, ix = torch.topk(lp[i], min(k, lp.shape[1]))
                top = list(zip(ix.tolist(), v.tolist(), strict=True))
            info[i] = (float(lp[i, toks[i]]), top)
    return toks, info
