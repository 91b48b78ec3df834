"""Token sampling on the last stage: greedy, temperature, top-k, top-p, per-row seeds,
and log-probabilities of the chosen and the most likely tokens.

One :class:`SamplingParams` per request carries the API's sampling fields from the
protocol model (:meth:`convergent.serve.protocol._Sampling.sampling_params`) through the
engine's :class:`~convergent.serve.scheduler_base.Request`; the engine gathers the rows
of a micro-batch into one :class:`RowParams` (:meth:`RowParams.add`), which the last
stage hands to :func:`sample_rows` and :func:`row_logprobs` as it is.

The order of the filters is that of transformers' ``generate``: temperature, then top-k,
then top-p (the nucleus keeps the smallest set whose probability reaches ``top_p``, at
least one token). Everything runs batched on the logits' device (:func:`sample_device`:
one sort for top-k and top-p of all rows, no per-row kernel and no host round trip) and
the step's one device-to-host copy is the sampled tokens. The draw is the Gumbel-max
race: ``argmax(filtered log-probabilities + Gumbel noise)`` samples exactly from the
filtered distribution, and the noise of a row is a counter-based hash of the row's seed
(the request's seed and the token's position) and the token id (:func:`seeded_gumbel`):
no generator state, so a request's tokens depend neither on the batch it happened to
share nor on the order of the rows, and the same seed gives the same tokens on every run.
Log-probabilities are those of the model's raw distribution (``log_softmax`` of the
logits, before temperature and filters), as vLLM reports them.

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
    "sample_device",
    "sample_rows",
    "seeded_gumbel",
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


_M32 = 0xFFFFFFFF


def _mix32(x):
    """A 32-bit integer hash (two multiply-xorshift rounds) of ``x`` in ``[0, 2**32)``,
    in int64 arithmetic that never overflows (constants below ``2**27``)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def seeded_gumbel(seeds, vocab: int):
    """Gumbel(0, 1) noise ``[R, vocab]`` (float32) on ``seeds``' device: element ``(i, v)``
    is a function of ``seeds[i]`` (int64) and ``v`` alone (48 random bits of a counter
    hash), so it is the same in any batch, row order and run."""
    import torch

    s = seeds.to(torch.int64)[:, None]
    key = _mix32(_mix32(s & _M32) ^ ((s >> 32) & _M32))  # [R, 1]
    v = torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None, :]
    h1 = _mix32((key + v * 0x9E3779B1) & _M32)
    h2 = _mix32(h1 ^ 0x5BD1E995)
    u = ((h1 >> 8).double() * 2.0**-24 + (h2 >> 8).double() * 2.0**-48 + 2.0**-49)
    return (-torch.log(-torch.log(u))).float()


def _row_tensors(p: RowParams, device):
    """The rows' temperatures, top-k, top-p and seeds as device tensors (one upload)."""
    import numpy as np
    import torch

    n = len(p.temperatures)
    host = np.empty((4, n), np.int64)
    host[0] = np.asarray(p.temperatures, np.float64).view(np.int64)
    host[1] = p.top_ks
    host[2] = np.asarray(p.top_ps, np.float64).view(np.int64)
    host[3] = np.asarray(p.seeds, np.int64) & 0x7FFFFFFFFFFFFFFF
    t = torch.from_numpy(host)
    if torch.device(device).type == "cuda":  # pinned: a copy the host does not wait for
        t = t.pin_memory().to(device, non_blocking=True)
    return t[0].view(torch.float64).float(), t[1], t[2].view(torch.float64), t[3]


def filter_rows(x, top_k, top_p, use_top_p: bool = True):
    """Rows of scaled logits ``x`` [R, V] with each row's top-k (``top_k[i] <= 0``: off)
    and top-p (``top_p[i] >= 1``: off) applied (-inf): :func:`filter_logits` batched, with
    one ascending sort for both and transformers' arithmetic (the nucleus drops the tokens
    whose ascending cumulative probability is at most ``1 - top_p``, keeping the likeliest)."""
    import torch

    v = x.shape[-1]
    srt, idx = torch.sort(x, dim=-1, descending=False)
    k = torch.where((top_k > 0) & (top_k < v), top_k, v)
    kth = srt.gather(1, (v - k)[:, None])  # [R, 1] the k-th largest
    drop_sorted = srt < kth  # ties with the k-th stay, as with topk's value
    if use_top_p:
        cum = torch.softmax(srt.masked_fill(drop_sorted, float("-inf")), -1).cumsum(-1)
        nucleus = (cum <= (1 - top_p).float()[:, None]) & (top_p < 1.0)[:, None]
        nucleus[:, -1] = False  # keep at least the most likely token
        drop_sorted = drop_sorted | nucleus
    drop = torch.zeros_like(drop_sorted).scatter_(1, idx, drop_sorted)
    return x.masked_fill(drop, float("-inf"))


def sample_device(logits, p: RowParams):
    """The sampled token of each row of ``logits`` [R, V] (float32) as an int64 device
    tensor (no host round trip): the argmax where the temperature is 0, else the
    Gumbel-max draw from the temperature-scaled, top-k / top-p filtered distribution
    with the row's seed (:func:`seeded_gumbel`)."""
    import torch

    greedy = logits.argmax(-1)
    if not any(t > 0 for t in p.temperatures):
        return greedy
    temp, top_k, top_p, seeds = _row_tensors(p, logits.device)
    drawn = temp > 0
    x = logits / torch.where(drawn, temp, 1.0)[:, None]
    x = filter_rows(x, top_k, top_p, use_top_p=any(t < 1.0 for t in p.top_ps))
    race = torch.log_softmax(x, -1) + seeded_gumbel(seeds, x.shape[-1])
    return torch.where(drawn, race.argmax(-1), greedy)


def sample_rows(logits, p: RowParams) -> list[int]:
    """:func:`sample_device`'s tokens on the host (the step's one device-to-host copy)."""
    return sample_device(logits, p).tolist()


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
    row asks for them (``p.logprobs[i] >= 0``), else ``None``. The log-softmax and the
    top-k run on the device; the chosen and the top values come over in one copy."""
    import torch

    info: list[TokenLogprobs | None] = [None] * len(toks)
    ask = [i for i, k in enumerate(p.logprobs) if k >= 0]
    if not ask:
        return info
    lp = torch.log_softmax(logits, -1)
    kmax = min(max(p.logprobs[i] for i in ask), lp.shape[-1])
    chosen = lp.gather(1, torch.as_tensor(toks, device=lp.device)[:, None])[:, 0]
    v, ix = torch.topk(lp, kmax) if kmax > 0 else (lp[:, :0], lp[:, :0].long())
    host = torch.cat([chosen[:, None].double(), v.double(), ix.double()], 1).cpu()
    for i in ask:
        k, row = p.logprobs[i], host[i]
        top = zip(row[1 + kmax : 1 + kmax + k].long().tolist(), row[1 : 1 + k].float().tolist(),
                  strict=True)
        info[i] = TokenLogprobs(float(row[0].float()), dict(top))
    return info


def prompt_logprobs(logits, targets: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Per row of ``logits`` [R, V] (float32; row ``i`` at the prompt position before
    ``targets[i]``): the logprob of the prompt token ``targets[i]`` and the top ``ks[i]``."""
    import torch

    lp = torch.log_softmax(logits, -1).cpu()
    return [_entry(lp[i], t, k) for i, (t, k) in enumerate(zip(targets, ks, strict=True))]
