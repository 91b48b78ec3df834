"""Token sampling on the last stage: greedy, temperature, top-k, top-p, per-row seeds,
and log-probabilities of the chosen and the most likely tokens.

One :class:`SamplingParams` per request carries the API's sampling fields from the
protocol model (:meth:`convergent.serve.protocol._Sampling.sampling_params`) through the
engine's :class:`~convergent.serve.scheduler_base.Request`; the engine gathers the rows
of a micro-batch into one :class:`RowParams` (:meth:`RowParams.add`), which the last
stage hands to :func:`sample_rows` and :func:`row_logprobs` as it is.

The order of the filters is that of transformers' ``generate``: temperature, then top-k,
then top-p (the nucleus keeps the smallest set whose probability reaches ``top_p``, at
least one token). Each sampled row draws from its own ``torch.Generator`` seeded with the
request's seed and the token's position, so a request's tokens do not depend on the
batch it happened to share. Log-probabilities are those of the model's raw distribution
(``log_softmax`` of the logits, before temperature and filters), as vLLM reports them.

Prompt logprobs (the completions API's ``echo`` with ``logprobs``, what
lm-evaluation-harness's loglikelihood tasks read) come from the same prefill: the logits
at prompt position ``p`` score prompt token ``p + 1`` (:func:`prompt_logprobs`); the first
prompt token has none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "RowParams",
    "SamplingParams",
    "TokenLogprobs",
    "filter_logits",
    "prompt_logprobs",
    "row_logprobs",
    "sample_rows",
]

SEED_STRIDE = 1_000_003  # a row's seed: request seed * SEED_STRIDE + token position


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are drawn (defaults: greedy, no logprobs)."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # <= 0: off
    top_p: float = 1.0  # 1.0: off
    seed: int = 0  # with the token's position, the seed of each draw
    logprobs: int = -1  # -1: none; k >= 0: the chosen token's logprob and the top k
    prompt_logprobs: int = -1  # -1: none; k >= 0: each prompt token's logprob and the top k

    def row_seed(self, position: int) -> int:
        """The seed of the draw of the token at ``position`` (tokens before it)."""
        return self.seed * SEED_STRIDE + position


@dataclass
class RowParams:
    """Sampling settings of the sampled rows of one micro-batch, as columns (plain lists:
    cheap to pickle); row ``i`` is the ``i``-th :meth:`add`."""

    temperatures: list[float] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)  # per row: request seed and position
    top_ks: list[int] = field(default_factory=list)  # <= 0: off
    top_ps: list[float] = field(default_factory=list)  # 1.0: off
    logprobs: list[int] = field(default_factory=list)  # -1: none; k: chosen + top k

    def add(self, p: SamplingParams, position: int) -> None:
        """Append the row of a request sampling the token at ``position``."""
        self.temperatures.append(p.temperature)
        self.seeds.append(p.row_seed(position))
        self.top_ks.append(p.top_k)
        self.top_ps.append(p.top_p)
        self.logprobs.append(p.logprobs)


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities (nats, raw distribution) of a sampled token and of the ``k``
    most likely tokens at its position."""

    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # token id -> logprob, likeliest first


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


def sample_rows(logits, p: RowParams) -> list[int]:
    """The sampled token of each row of ``logits`` [R, V] (float32): the argmax where the
    temperature is 0, else a seeded draw from the filtered distribution."""
    import torch

    toks = logits.argmax(-1).tolist()  # greedy rows: the step's one device-to-host wait
    drawn = [i for i, t in enumerate(p.temperatures) if t > 0]
    if not drawn:
        return toks
    # the rows drawn on the host come over in one copy (stacked on the device: no index
    # tensor goes up), not one per row
    rows = torch.stack([logits[i] for i in drawn]).cpu()
    for r, i in enumerate(drawn):
        x = filter_logits(rows[r], p.temperatures[i], p.top_ks[i], p.top_ps[i])
        g = torch.Generator().manual_seed(p.seeds[i] & 0x7FFFFFFFFFFF)
        toks[i] = int(torch.multinomial(torch.softmax(x, -1), 1, generator=g))
    return toks


def _entry(lp_row, tok: int, k: int) -> TokenLogprobs:
    """The logprob of ``tok`` and the ``k`` likeliest tokens of one row of log-probabilities."""
    import torch

    top: dict[int, float] = {}
    if k > 0:
        v, ix = torch.topk(lp_row, min(k, lp_row.shape[0]))
        top = dict(zip(ix.tolist(), v.tolist(), strict=True))
    return TokenLogprobs(float(lp_row[tok]), top)


def row_logprobs(logits, toks: list[int], p: RowParams) -> list[TokenLogprobs | None]:
    """Per row, the logprobs of its sampled token ``toks[i]`` and its top ``k`` where the
    row asks for them (``p.logprobs[i] >= 0``), else ``None``."""
    import torch

    info: list[TokenLogprobs | None] = [None] * len(toks)
    if not any(k >= 0 for k in p.logprobs):
        return info
    lp = torch.log_softmax(logits, -1).cpu()
    for i, k in enumerate(p.logprobs):
        if k >= 0:
            info[i] = _entry(lp[i], toks[i], k)
    return info


def prompt_logprobs(logits, targets: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Per row of ``logits`` [R, V] (float32; row ``i`` at the prompt position before
    ``targets[i]``): the logprob of the prompt token ``targets[i]`` and the top ``ks[i]``."""
    import torch

    lp = torch.log_softmax(logits, -1).cpu()
    return [_entry(lp[i], t, k) for i, (t, k) in enumerate(zip(targets, ks, strict=True))]
