"""The Llama decoder modules: RMSNorm, gated MLP, grouped-query attention with RoPE,
decoder layers, the (possibly partial: one pipeline stage) body and the LM head.

Each module has a dense causal ``forward`` (training / scoring) and a ``forward_paged``
over a packed batch whose keys/values live in a paged cache (serving; the batch
metadata and the attention kernel are in :mod:`convergent.models.llama_paged`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from convergent.models.llama_config import MLP_ACTS, LlamaConfig
from convergent.models.llama_paged import PagedBatch, serving_attention
from convergent.models.llama_rope import Rotary, apply_rope_signed, signed_sin
from convergent.models.paged_linear import AttentionProjections, MLPProjections

__all__ = ["Attention", "DecoderLayer", "LlamaForCausalLM", "LlamaModel", "MLP", "RMSNorm"]


class RMSNorm(nn.Module):
    """Root-mean-square norm (computed in float32, like the reference). On the CPU in
    float32, ``F.rms_norm``: one call instead of eight, equal to them bit for bit (its CPU
    kernel composes the same ops: tests/models/test_llama_rmsnorm.py)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and x.device.type == "cpu":  # one op, the same bits
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class MLP(nn.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)); act = SiLU (SwiGLU) by default."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.serving: MLPProjections | None = None  # fused projections, set by fuse_for_serving
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)
        self.act = MLP_ACTS[c.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))

    def forward_paged(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The serving forward plus the residual stream: ``residual + mlp(x)``, with one
        gate-up GEMM and the residual added by the down GEMM where :attr:`serving` is set."""
        if self.serving is None:
            return residual + self(x)
        gu = self.serving.gate_up(x)
        i = gu.shape[-1] // 2
        h = self.act(gu[:, :i])
        return self.serving.down(h.mul_(gu[:, i:]), residual)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        # fused projections, set by fuse_for_serving
        self.serving: AttentionProjections | None = None
        self.nq, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.nq * self.hd, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.nq * self.hd, c.hidden_size, bias=c.attention_bias)
        self.scale = self.hd**-0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Dense causal attention: x [B, S, H]; cos/sin [S, head_dim]."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b * s, self.nq, self.hd)
        k = self.k_proj(x).view(b * s, self.nkv, self.hd)
        v = self.v_proj(x).view(b, s, self.nkv, self.hd)
        cos_f, sin_f = cos.repeat(b, 1), signed_sin(sin).repeat(b, 1)
        q = apply_rope_signed(q, cos_f, sin_f).view(b, s, self.nq, self.hd).transpose(1, 2)
        k = apply_rope_signed(k, cos_f, sin_f).view(b, s, self.nkv, self.hd).transpose(1, 2)
        v = v.transpose(1, 2)
        rep = self.nq // self.nkv
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, self.nq * self.hd))

    def forward_paged(
        self,
        x: torch.Tensor,
        batch: PagedBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        residual: torch.Tensor,
    ) -> torch.Tensor:
        """Packed attention over a paged cache, plus the residual stream.

        x [T, H]; k_cache / v_cache [num_slots, n_kv_heads, head_dim] (written in place);
        returns ``residual + attention(x)``. Everything runs in ``x.dtype`` (the serving
        dtype: RoPE tables are cast to it, like transformers); the attention itself is
        :func:`~convergent.models.llama_paged.paged_attention`.
        """
        q, k, v = self.project_paged(x, *batch.rope(x.dtype))
        out = batch.attend(q, k, v, k_cache, v_cache, self.scale)
        return self.output_paged(out, residual)

    def project_paged(self, x: torch.Tensor, cos: torch.Tensor,
                      sin_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The queries, keys (RoPE applied: cos and the signed sin of
        :func:`~convergent.models.llama_rope.apply_rope_signed`) and values of x [T, H]:
        [T, nq, hd], [T, nkv, hd], [T, nkv, hd] (the work before the attention)."""
        t = x.shape[0]
        nq, nkv, hd = self.nq, self.nkv, self.hd
        if self.serving is not None:  # one QKV GEMM, RoPE on queries and keys at once
            qkv = self.serving.qkv(x).view(t, nq + 2 * nkv, hd)
            qk = apply_rope_signed(qkv[:, : nq + nkv], cos, sin_s)
            return qk[:, :nq], qk[:, nq:], qkv[:, nq + nkv :]
        q = apply_rope_signed(self.q_proj(x).view(t, nq, hd), cos, sin_s)
        k = apply_rope_signed(self.k_proj(x).view(t, nkv, hd), cos, sin_s)
        return q, k, self.v_proj(x).view(t, nkv, hd)

    def output_paged(self, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + o_proj(out)`` for the attention output out [T, nq, hd] (the work
        after the attention; the residual added in the output GEMM where fused)."""
        out = out.reshape(out.shape[0], self.nq * self.hd)
        if self.serving is not None:
            return self.serving.o(out, residual)
        return residual + self.o_proj(out)


class DecoderLayer(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)); x + mlp(norm(x))."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_paged(
        self, x: torch.Tensor, batch: PagedBatch, kc: torch.Tensor, vc: torch.Tensor
    ) -> torch.Tensor:
        x = self.self_attn.forward_paged(self.input_layernorm(x), batch, kc, vc, residual=x)
        return self.mlp.forward_paged(self.post_attention_layernorm(x), residual=x)


class LlamaModel(nn.Module):
    """The decoder body, optionally only a slice of layers (a pipeline stage).

    ``layers``: global indices held by this module (default all); ``embed``: holds the
    token embedding (first stage); ``head``: holds the final norm (last stage).
    """

    def __init__(
        self,
        config: LlamaConfig,
        layers: Iterable[int] | None = None,
        embed: bool = True,
        head: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        idx = list(range(config.num_hidden_layers)) if layers is None else list(layers)
        self.layer_ids = idx
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if embed else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config) for i in idx})
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if head else None
        self.rotary = Rotary(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Dense causal forward: token ids [B, S] (if embedding held) or hidden [B, S, H]."""
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        s = x.shape[1]
        cos, sin = self.rotary.cos_sin(torch.arange(s, device=x.device), seq_len=s, dtype=x.dtype)
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        return self.norm(x) if self.norm is not None else x

    def forward_paged(
        self,
        x: torch.Tensor,
        batch: PagedBatch,
        kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Serving forward over a packed batch: ids [T] or hidden [T, H] -> hidden [T, H].

        ``kv[j]`` is the (key, value) cache of the ``j``-th layer held by this module.
        """
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        batch.prepare(self.rotary)
        with serving_attention(x.device):
            for j, layer in enumerate(self.layers.values()):
                x = layer.forward_paged(x, batch, kv[j][0], kv[j][1])
        return self.norm(x) if self.norm is not None else x


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. ``LlamaForCausalLM(config)(input_ids) -> logits``.

    For a pipeline stage pass ``layers``/``embed``/``head``; the LM head exists only
    when ``head`` is true.
    """

    def __init__(
        self,
        config: LlamaConfig,
        layers: Iterable[int] | None = None,
        embed: bool = True,
        head: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        self.serving_head = None  # the LM head as a ServingLinear, set by fuse_for_serving
        self.model = LlamaModel(config, layers, embed, head)
        self.lm_head = (
            nn.Linear(config.hidden_size, config.vocab_size, bias=False) if head else None
        )
        if head and embed and config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float | None = None, seed: int | None = None) -> None:
        """Normal(0, std) weights (default ``initializer_range``), unit norms, zero biases."""
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        s = self.config.initializer_range if std is None else std
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * s)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [B, S] -> logits [B, S, vocab] (dense causal; training / scoring)."""
        h = self.model(input_ids)
        return self.lm_head(h) if self.lm_head is not None else h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states -> logits (last stage only)."""
        assert self.lm_head is not None, "this stage has no LM head"
        head = self.serving_head
        return head(hidden) if head is not None else self.lm_head(hidden)

    @torch.no_grad()
    def generate_greedy(self, input_ids: list[int], max_new_tokens: int) -> list[int]:
        """Reference greedy decoding without a cache (quadratic; for tests and tiny models)."""
        ids = list(input_ids)
        out: list[int] = []
        for _ in range(max_new_tokens):
            logits = self(torch.tensor([ids]))[0, -1]
            nxt = int(logits.argmax())
            out.append(nxt)
            ids.append(nxt)
        return out
