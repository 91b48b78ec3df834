"""Stage cost table: predicted seconds for one stage to run one micro-batch.

A linear model per decoder layer over the batch shape
``t_layer = c0 + c1 * tokens + c2 * prefill_attention_pairs + c3 * decode_context_tokens``
plus the LM head on the last stage ``t_head = h0 + h1 * sampled_rows`` and a fixed
per-micro-batch engine/communication overhead. :func:`profile_costs` fits it on the
device at start-up (used by the TD-Pipe switch rule and by the simulator);
:func:`published_l20_llama2_13b` builds one from GPU specs for projection.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from convergent.core.fsutil import dumps_json

if TYPE_CHECKING:
    import torch

    from convergent.models.llama_config import LlamaConfig

__all__ = ["BatchShape", "CostTable", "profile_costs", "published_l20_llama2_13b"]


@dataclass
class BatchShape:
    """What a cost depends on: token counts of one micro-batch."""

    prefill_tokens: int = 0  # new tokens of prefill / chunked-prefill items
    prefill_pairs: int = 0  # sum over prefill items of query_len * context_len
    decode_seqs: int = 0  # items with one new token
    decode_ctx: int = 0  # sum of their context lengths
    sampled: int = 0  # rows that go through the LM head

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs

    def features(self) -> list[float]:
        return [1.0, self.tokens, self.prefill_pairs, self.decode_ctx]


@dataclass
class CostTable:
    """Per-stage time model (seconds); ``layers_per_stage`` says how layers are split."""

    layer_coef: list[float] = field(default_factory=lambda: [1e-4, 1e-5, 1e-8, 1e-8])
    head_coef: list[float] = field(default_factory=lambda: [1e-4, 1e-5])
    overhead: float = 2e-4  # per micro-batch per stage: metadata, point-to-point send
    overhead_per_token: float = 0.0
    layers_per_stage: list[int] = field(default_factory=lambda: [1])
    source: str = "default"
    # optional per-stage models fitted on a run (see calibrate_from_run): seconds =
    # dot(coef, [1, tokens, prefill_pairs, decode_ctx, sampled]); replaces the layer model
    stage_coef: list[list[float]] | None = None
    dispatch: float = 0.0  # engine: submit -> stage 0 start (when stage 0 is idle)
    hop: float = 0.0  # stage s end -> stage s+1 start (when s+1 is idle)
    ret: float = 0.0  # last stage end -> its result received by the engine
    # per stage: end of one micro-batch -> start of the next when the next one's input
    # was already there (queue hand-off, wake-up; grows when the CPU is oversubscribed)
    turnaround: list[float] | None = None

    def stage_time(self, shape: BatchShape, stage: int) -> float:
        if self.stage_coef is not None:
            f = [*shape.features(), shape.sampled]
            return max(0.0, float(np.dot(self.stage_coef[stage], f)))
        lt = max(0.0, float(np.dot(self.layer_coef, shape.features())))
        t = (
            self.layers_per_stage[stage] * lt
            + self.overhead
            + self.overhead_per_token * shape.tokens
        )
        if stage == len(self.layers_per_stage) - 1:
            t += max(0.0, self.head_coef[0] + self.head_coef[1] * shape.sampled)
        return t

    def max_stage_time(self, shape: BatchShape) -> float:
        return max(self.stage_time(shape, s) for s in range(len(self.layers_per_stage)))

    def prefill_time(self, length: int, stage: int | None = None) -> float:
        """One-sequence prefill of ``length`` tokens on the slowest (or given) stage."""
        s = BatchShape(prefill_tokens=length, prefill_pairs=length * (length + 1) // 2, sampled=1)
        return self.max_stage_time(s) if stage is None else self.stage_time(s, stage)

    def decode_time(self, batch: int, mean_ctx: float = 256.0) -> float:
        """A decode micro-batch of ``batch`` sequences on the slowest stage."""
        s = BatchShape(decode_seqs=batch, decode_ctx=int(batch * mean_ctx), sampled=batch)
        return max(1e-9, self.max_stage_time(s))

    def with_stages(self, layers_per_stage: list[int]) -> CostTable:
        d = asdict(self)
        d["layers_per_stage"] = list(layers_per_stage)
        return CostTable(**d)

    def to_json(self) -> str:
        return dumps_json(asdict(self), indent=1)

    def save(self, path: str | Path) -> None:
        from convergent.core.fsutil import atomic_write_text

        atomic_write_text(path, self.to_json())


def _fit(rows: list[list[float]], times: list[float]) -> list[float]:
    """Non-negative least squares of ``times`` on ``rows``; repeated rows (the same batch
    shape timed several times) enter once, with their median time, so one interrupted
    repetition on a shared CPU does not pull the fit."""
    groups: dict[tuple, list[float]] = {}
    for r, t in zip(rows, times, strict=True):
        groups.setdefault(tuple(r), []).append(t)
    rows = [list(k) for k in groups]
    times = [float(np.median(v)) for v in groups.values()]
    a, y = np.asarray(rows, float), np.asarray(times, float)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    # a negative coefficient is noise: drop the most negative term and refit (small NNLS)
    active = list(range(a.shape[1]))
    while True:
        coef = np.zeros(a.shape[1])
        sol, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        coef[active] = sol
        if (coef >= 0).all() or len(active) == 1:
            return [float(max(c, 0.0)) for c in coef]
        active.remove(int(np.argmin(coef)))


def profile_costs(
    config: LlamaConfig,
    layers_per_stage: list[int],
    block_size: int = 16,
    reps: int = 3,
    max_len: int = 512,
    max_batch: int = 64,
    dtype: torch.dtype | None = None,
) -> CostTable:
    """Time one decoder layer and the LM head on this device over a grid of batch shapes.

    ``config`` is a :class:`~convergent.models.llama.LlamaConfig`. Takes a few seconds
    for small models; each shape is timed ``reps`` times and the minimum is kept.
    """
    import torch

    from convergent.models.llama import LlamaForCausalLM, PagedBatch
    from convergent.serve.kv_cache import KVCache

    dtype = dtype or torch.float32
    with torch.no_grad():
        body = LlamaForCausalLM(config, layers=[0], embed=False, head=False).to(dtype).eval()
        head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False).to(dtype)
        n_ctx = max_len * 2 + max_batch * max_len
        nb = -(-n_ctx // block_size) + 4
        kv = KVCache(1, nb, block_size, config.num_key_value_heads, config.head_dim, dtype)
        shapes: list[tuple[list[int], list[int]]] = []  # (query_lens, context_lens)
        for ln in (8, 32, 128, max_len // 2, max_len):
            shapes.append(([ln], [ln]))
        shapes.append(([64] * 4, [64] * 4))
        for b in (1, 4, 16, max_batch):
            for ctx in (32, max_len // 2, max_len):
                shapes.append(([1] * b, [ctx] * b))
        shapes.append(([1] * 8 + [128], [200] * 8 + [128]))
        rows, times = [], []
        for ql, cl in shapes:
            tables, slots, pos = [], [], []
            nxt = 0
            for q, c in zip(ql, cl, strict=True):
                nblk = -(-c // block_size)
                t = list(range(nxt, nxt + nblk))
                nxt += nblk
                tables.append(t)
                for p in range(c - q, c):
                    slots.append(t[p // block_size] * block_size + p % block_size)
                    pos.append(p)
            x = torch.randn(sum(ql), config.hidden_size, dtype=dtype)
            best = float("inf")
            for _ in range(reps):
                b = PagedBatch(torch.tensor(pos), torch.tensor(slots), ql, cl, tables, block_size)
                t0 = time.perf_counter()
                body.model.forward_paged(x, b, kv.layers)
                best = min(best, time.perf_counter() - t0)
            shape = BatchShape(
                prefill_tokens=sum(q for q in ql if q > 1),
                prefill_pairs=sum(q * c for q, c in zip(ql, cl, strict=True) if q > 1),
                decode_seqs=sum(1 for q in ql if q == 1),
                decode_ctx=sum(c for q, c in zip(ql, cl, strict=True) if q == 1),
            )
            rows.append(shape.features())
            times.append(best)
        layer_coef = _fit(rows, times)
        hrows, htimes = [], []
        for n in (1, 8, 32, max_batch):
            h = torch.randn(n, config.hidden_size, dtype=dtype)
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                head(h).argmax(-1)
                best = min(best, time.perf_counter() - t0)
            hrows.append([1.0, n])
            htimes.append(best)
        head_coef = _fit(hrows, htimes)
    return CostTable(layer_coef, head_coef, 2e-4, 0.0, list(layers_per_stage), "profiled")


def calibrate_from_run(batch_log: dict[int, dict], base: CostTable) -> CostTable:
    """Fit per-stage time models on the busy intervals of a measured run.

    ``batch_log`` is :attr:`convergent.serve.stats.EngineStats.batch_log`. Also measures
    the engine's dispatch latency and the stage-to-stage hop latency (medians over
    micro-batches that found the next stage idle) and the result's return latency to
    the engine (median; entries with a ``recv`` time), and each stage's turnaround
    between back-to-back micro-batches (median). Used to check the simulator's
    scheduling/bubble model separately from the start-up profile's accuracy.
    """
    entries = [e for e in batch_log.values() if e["stages"]]
    p = len(base.layers_per_stage)
    coefs = []
    for s in range(p):
        rows, ys = [], []
        for e in entries:
            if s in e["stages"]:
                sh = e["shape"]
                rows.append([*sh.features(), sh.sampled])
                t0, t1 = e["stages"][s]
                ys.append(t1 - t0)
        coefs.append(_fit(rows, ys) if len(rows) >= 6 else [0.0] * 5)
    # latencies: only batches whose stage was idle when they arrived
    disp, hops = [], []
    turn: list[list[float]] = [[] for _ in range(p)]
    rets = [
        e["recv"] - e["stages"][p - 1][1] for e in entries if "recv" in e and p - 1 in e["stages"]
    ]
    ends: dict[int, float] = {}
    for e in sorted(entries, key=lambda x: x["submit"]):
        st = e["stages"]
        if 0 in st and st[0][0] - e["submit"] >= 0 and (0 not in ends or ends[0] <= e["submit"]):
            disp.append(st[0][0] - e["submit"])
        for s in range(1, p):
            if s in st and s - 1 in st and (s not in ends or ends[s] <= st[s - 1][1]):
                hops.append(max(0.0, st[s][0] - st[s - 1][1]))
        for s in range(p):  # back to back: the input was ready before the stage was free
            ready = e["submit"] if s == 0 else st.get(s - 1, (0.0, float("inf")))[1]
            if s in st and s in ends and ready <= ends[s]:
                turn[s].append(max(0.0, st[s][0] - ends[s]))
        for s, (_, t1) in st.items():
            ends[s] = t1
    d = asdict(base)
    d.update(
        stage_coef=coefs,
        dispatch=float(np.median(disp)) if disp else 0.0,
        hop=float(np.median(hops)) if hops else 0.0,
        ret=max(0.0, float(np.median(rets))) if rets else 0.0,
        turnaround=[float(np.median(x)) if x else 0.0 for x in turn],
        source="calibrated on a run",
    )
    return CostTable(**d)


def published_l20_llama2_13b(stages: int = 4) -> CostTable:
    """A cost table for Llama-2-13B (fp16) on NVIDIA L20 GPUs, one stage per GPU.

    Derived from the L20's published specs (864 GB/s memory bandwidth, ~119.5 dense fp16
    TFLOPS) with a roofline: a layer reads its ~0.63 GB of weights once per micro-batch
    (~1 ms at 75 % of peak bandwidth), spends 2 FLOP per weight per token at ~55 % of
    peak, reads 20 KB of K/V per context token (2 * 5120 * 2 bytes), and 4 * 5120 FLOP per
    (query, key) pair in prefill attention; ~0.3 ms point-to-point + launch overhead per
    micro-batch. This is NOT TD-Pipe's measured L20 profile (not available offline).
    """
    layers = 40
    per_layer_weight_bytes = (4 * 5120 * 5120 + 3 * 5120 * 13824) * 2  # attn + SwiGLU, fp16
    bw = 864e9 * 0.75
    flops = 119.5e12 * 0.55
    kv_bytes_per_ctx_token = 2 * 5120 * 2
    c0 = per_layer_weight_bytes / bw  # weight read per micro-batch
    c1 = 2 * per_layer_weight_bytes / 2 / flops  # 2 FLOP per weight per token
    c2 = 4 * 5120 / flops  # attention score+value FLOPs per (query, key) pair
    c3 = kv_bytes_per_ctx_token / bw
    per_stage = [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]
    vocab_bytes = 32000 * 5120 * 2
    return CostTable(
        [c0, c1, c2, c3],
        [vocab_bytes / bw, 2 * 32000 * 5120 / flops],
        3e-4,
        2e-8,
        per_stage,
        "roofline: L20 specs, Llama-2-13B fp16",
    )
