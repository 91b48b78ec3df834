"""Mixed steps through static buffers padded to token buckets: each layer's dense work
replayed as CUDA graphs ("pieces"), the attention run eagerly between them.

A step that is not a pure decode (prefills, prompt chunks and decodes together: on a busy
server most steps refill a finished sequence's slot, so most steps) cannot be one CUDA
graph: its attention depends on how many prompts of which lengths it holds. Run eagerly, it
is ~30 ops a layer, each a Python dispatch and a kernel launch: on an H100 at 4e3e605 such
a step cost ~50 ms of host time against ~7 ms for a graphed decode step, and the 522 mixed
steps of the 1,000-request trace were ~26 s of its 36.5 s. vLLM v1 splits its compiled
graph at the attention ("piecewise CUDA graphs"); this is that split, by hand:

* piece 0: the embedding (first stage) and the RoPE tables of the step's positions, then
  layer 0's input norm, QKV projection and RoPE into the static ``q``, ``k``, ``v``;
* piece ``i`` (1 .. L-1): layer ``i-1``'s output projection, residual, post-attention norm
  and MLP, then layer ``i``'s norm, QKV and RoPE;
* piece ``L``: the last layer's output projection and MLP, then the final norm (last
  stage).

Between pieces ``i`` and ``i+1`` layer ``i``'s attention runs eagerly on the step's real
rows (``[:T]`` of the static buffers; :func:`~convergent.models.llama_paged.paged_attention`
writes the KV cache and its output into the static ``attn``), with the step's
:class:`~convergent.models.llama_paged.PagedBatch` as the eager path builds it. A step of
``T`` tokens runs as the smallest bucket ``b >= T`` of :func:`token_buckets`: every op of a
piece is row-wise, so the ``b - T`` padding rows (stale ids and positions of earlier steps)
never reach a real row, and attention never sees them.

:meth:`MixedGraphs.capture` records one graph per bucket and piece, largest bucket first,
in one memory pool (each piece writes its results into the static buffers with
``copy_``, so nothing a later piece reads lives in the pool). Without capture (the CPU,
``serve.engine.cuda_graphs=on``) :meth:`MixedGraphs.run` runs the same pieces eagerly
through the same buffers: the CPU tests' check of the split and the padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from convergent.models.llama_paged import PagedBatch, paged_attention, serving_attention
from convergent.models.llama_rope import signed_sin

__all__ = ["MixedGraphs", "token_buckets"]


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts captured for steps of up to ``max_tokens`` tokens: 16, 32, ..., 512,
    then every 512 (a step pads at most 512 rows past 1,024), and ``max_tokens``."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: need at least 1")
    out = {b for b in (16, 32, 64, 128, 256) if b <= max_tokens}
    out.update(range(512, max_tokens + 1, 512))
    out.add(max_tokens)
    return sorted(out)


class MixedGraphs:
    """Static buffers of one stage's model slice for steps of up to ``max_tokens`` tokens;
    per bucket and piece (when captured) a CUDA graph. ``model`` is a
    :class:`~convergent.models.llama_model.LlamaForCausalLM` slice, ``kv`` its layers'
    ``(key, value)`` caches."""

    def __init__(self, model: Any, kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 max_tokens: int, *, first: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.body, self.kv, self.first = model.model, kv, first
        self.layers = list(self.body.layers.values())
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.buckets = token_buckets(max_tokens)
        attn = self.layers[0].self_attn
        n, hidden = self.buckets[-1], self.body.config.hidden_size
        new = dict(dtype=dtype, device=self.device)
        self._ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        self._pos = torch.zeros(n, dtype=torch.int64, device=self.device)
        self._res = torch.zeros(n, hidden, **new)  # the residual stream
        self._out = torch.zeros(n, hidden, **new)  # the final norm's output (last stage)
        self._cos = torch.zeros(n, attn.hd, **new)
        self._sin = torch.zeros(n, attn.hd, **new)  # signed, as apply_rope_signed takes it
        self._q = torch.zeros(n, attn.nq, attn.hd, **new)
        self._k = torch.zeros(n, attn.nkv, attn.hd, **new)
        self._v = torch.zeros(n, attn.nkv, attn.hd, **new)
        self._attn = torch.zeros(n, attn.nq, attn.hd, **new)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.replays = 0  # steps whose pieces were replayed from captured graphs
        self.static_runs = 0  # steps run through the static buffers without graphs

    def fits(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` tokens fits the largest bucket."""
        return 0 < num_tokens <= self.buckets[-1]

    def bucket(self, n: int) -> int:
        """The smallest bucket holding ``n`` tokens."""
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} tokens exceed the largest bucket {self.buckets[-1]}")

    # -- the pieces
    def _pre(self, j: int, b: int) -> None:
        """Layer ``j``'s input norm, QKV projection and RoPE into the static q, k, v."""
        layer = self.layers[j]
        q, k, v = layer.self_attn.project_paged(
            layer.input_layernorm(self._res[:b]), self._cos[:b], self._sin[:b])
        self._q[:b].copy_(q)
        self._k[:b].copy_(k)
        self._v[:b].copy_(v)

    def _post(self, j: int, b: int) -> None:
        """Layer ``j``'s output projection, residual and MLP into the residual stream."""
        layer = self.layers[j]
        x = layer.self_attn.output_paged(self._attn[:b], self._res[:b])
        self._res[:b].copy_(layer.mlp.forward_paged(layer.post_attention_layernorm(x),
                                                    residual=x))

    def _piece(self, i: int, b: int) -> None:
        """Piece ``i`` of bucket ``b`` (the module docstring lists them)."""
        if i == 0:
            if self.first:
                self._res[:b].copy_(self.body.embed_tokens(self._ids[:b]))
            cos, sin = self.body.rotary.cos_sin(self._pos[:b])
            self._cos[:b].copy_(cos)
            self._sin[:b].copy_(signed_sin(sin))
        else:
            self._post(i - 1, b)
        if i < len(self.layers):
            self._pre(i, b)
        elif self.body.norm is not None:
            self._out[:b].copy_(self.body.norm(self._res[:b]))

    def _run_piece(self, i: int, b: int) -> None:
        g = self._graphs.get((b, i))
        if g is not None:
            g.replay()
        else:
            self._piece(i, b)

    # -- running
    def run(self, x: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """The step's hidden states ``[T, H]`` (after the final norm on the last stage) for
        ``x``: its token ids ``[T]`` (first stage) or hidden states ``[T, H]``; a view of a
        static buffer that the next :meth:`run` overwrites. ``batch`` is the step's
        planned batch (its attention metadata; the RoPE tables are made in piece 0)."""
        t = batch.positions.numel()
        b = self.bucket(t)
        (self._ids if self.first else self._res)[:t].copy_(x)
        self._pos[:t].copy_(batch.positions)
        batch.plan()  # the attention's groups (the RoPE tables are piece 0's)
        captured = (b, 0) in self._graphs
        with serving_attention(self.device):
            for j, layer in enumerate(self.layers):
                self._run_piece(j, b)
                k_cache, v_cache = self.kv[j]
                paged_attention(self._q[:t], self._k[:t], self._v[:t], batch, k_cache,
                                v_cache, layer.self_attn.scale, out=self._attn[:t])
            self._run_piece(len(self.layers), b)
        if captured:
            self.replays += 1
        else:
            self.static_runs += 1
        return (self._out if self.body.norm is not None else self._res)[:t]

    def capture(self) -> None:
        """Capture every bucket's pieces (largest bucket first, one shared memory pool),
        each after a warm-up run on a side stream."""
        if not self.cuda:
            raise ValueError("CUDA graphs need a CUDA device; on the CPU run() is eager")
        pool = None
        side = torch.cuda.Stream(self.device)
        main = torch.cuda.current_stream(self.device)
        for b in reversed(self.buckets):
            for i in range(len(self.layers) + 1):
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    self._piece(i, b)
                main.wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
                    self._piece(i, b)
                pool = g.pool() if pool is None else pool
                self._graphs[(b, i)] = g
        torch.cuda.synchronize(self.device)

    @property
    def captured(self) -> bool:
        return bool(self._graphs)
