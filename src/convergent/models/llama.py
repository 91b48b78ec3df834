"""A Llama-architecture decoder: RMSNorm, RoPE (default / linear / dynamic NTK / llama3),
grouped-query attention, SwiGLU.

Two forwards share the same weights:

* ``LlamaForCausalLM(config)(input_ids) -> logits`` — a plain, dense, causal training
  forward (``input_ids`` of shape ``[batch, seq]``; logits ``[batch, seq, vocab]``).
* :meth:`LlamaModel.forward_paged` — the serving forward over a *packed* batch of
  sequences whose keys/values live in a paged KV cache (used by ``convergent.serve``).
  A model may hold only a contiguous slice of the layers (a pipeline stage):
  ``LlamaModel(config, layers=range(a, b), embed=..., head=...)``.

Parameter names follow Hugging Face (``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.q_proj.weight``, ..., ``lm_head.weight``) so a Hugging Face
checkpoint directory (``config.json`` + ``*.safetensors``) loads directly with
:func:`load_pretrained` and :func:`save_pretrained` writes one back.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LlamaConfig",
    "LlamaForCausalLM",
    "LlamaModel",
    "PagedBatch",
    "load_pretrained",
    "save_pretrained",
    "rope_inv_freq",
]


# ----------------------------------------------------------------------------- config


@dataclass
class LlamaConfig:
    """Hyper-parameters of a Llama decoder (Hugging Face ``config.json`` names).

    ``rope_scaling`` is ``None`` or a dict with ``rope_type`` in ``default``, ``linear``,
    ``dynamic``, ``llama3`` and its parameters (``factor``; for llama3 also
    ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"  # the gated MLP's activation (see MLP_ACTS)
    sliding_window: int | None = None  # Mistral: served only up to the window (exact)
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.rope_scaling is not None:
            rs = dict(self.rope_scaling)
            rs.setdefault("rope_type", rs.pop("type", "default"))
            rs.pop("rope_theta", None)
            self.rope_scaling = None if rs["rope_type"] == "default" else rs

    # -- constructors

    @classmethod
    def tiny(cls, **overrides: Any) -> LlamaConfig:
        """A ~0.1M-parameter model for tests (GQA: 4 query heads, 2 key/value heads)."""
        base = dict(
            vocab_size=320,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            bos_token_id=256,
            eos_token_id=257,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def small_30m(cls, **overrides: Any) -> LlamaConfig:
        """A ~30M-parameter model (8 layers, hidden 512, GQA 8/2 heads, vocab 8192)."""
        base = dict(
            vocab_size=8192,
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            bos_token_id=256,
            eos_token_id=257,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """Build from a Hugging Face ``config.json`` dict (transformers v4 or v5 layout)."""
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        rp = d.get("rope_parameters")  # transformers >= 5
        if isinstance(rp, dict):
            if "rope_theta" in rp:
                kw["rope_theta"] = rp["rope_theta"]
            if rp.get("rope_type", rp.get("type", "default")) != "default":
                kw["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
        if kw.get("rope_scaling") is not None and not isinstance(kw["rope_scaling"], dict):
            kw["rope_scaling"] = None
        return cls(**kw)

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict readable by transformers' ``LlamaConfig``."""
        d = asdict(self)
        d["model_type"] = "llama"
        d["architectures"] = ["LlamaForCausalLM"]
        rope = {"rope_type": "default"} if self.rope_scaling is None else dict(self.rope_scaling)
        rope["rope_theta"] = self.rope_theta
        d["rope_parameters"] = rope
        d["torch_dtype"] = "float32"
        return d

    @property
    def n_params(self) -> int:
        """Parameter count of the full model."""
        h, i, v, hd = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        nq, nkv = self.num_attention_heads, self.num_key_value_heads
        per_layer = h * hd * (2 * nq + 2 * nkv) + 3 * h * i + 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + emb + h

    @property
    def eos_ids(self) -> list[int]:
        """End-of-sequence ids as a list (may be empty)."""
        e = self.eos_token_id
        if e is None:
            return []
        return list(e) if isinstance(e, list | tuple) else [int(e)]

    @property
    def max_context(self) -> int:
        """Longest sequence the model is meant for: ``max_position_embeddings`` (times the
        factor of linear / dynamic RoPE scaling, as vLLM derives it), capped by a sliding
        window (within it, windowed attention equals full attention)."""
        n = self.max_position_embeddings
        rs = self.rope_scaling or {}
        if rs.get("rope_type") in ("linear", "dynamic"):
            n = int(n * float(rs.get("factor", 1.0)))
        if self.sliding_window:
            n = min(n, int(self.sliding_window))
        return n

    def kv_bytes_per_token(self, n_layers: int | None = None, dtype_bytes: int = 4) -> int:
        """Bytes of K and V cache per token over ``n_layers`` layers (default all)."""
        n = self.num_hidden_layers if n_layers is None else n_layers
        return 2 * n * self.num_key_value_heads * self.head_dim * dtype_bytes


# ----------------------------------------------------------------------------- rope


def rope_inv_freq(config: LlamaConfig, seq_len: int | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim/2]`` (float32) for the config's RoPE variant.

    ``seq_len`` matters only for ``dynamic`` (NTK-aware) scaling, where the base grows
    once the sequence is longer than ``max_position_embeddings``.
    """
    dim = config.head_dim
    base = float(config.rope_theta)
    rs = config.rope_scaling or {}
    kind = rs.get("rope_type", "default")
    if kind == "dynamic":
        factor = float(rs["factor"])
        mpe = config.max_position_embeddings
        sl = max(int(seq_len or mpe), mpe)
        base = base * ((factor * sl / mpe) - (factor - 1)) ** (dim / (dim - 2))
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "linear":
        inv = inv / float(rs["factor"])
    elif kind == "llama3":
        factor = float(rs["factor"])
        lo, hi = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old = float(rs["original_max_position_embeddings"])
        lo_wl, hi_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        inv_l = torch.where(wl > lo_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wl < hi_wl) * ~(wl > lo_wl)
        inv = torch.where(medium, smoothed, inv_l)
    elif kind not in ("default", "linear", "dynamic", "llama3"):
        raise ValueError(f"unsupported rope_type {kind!r} (default, linear, dynamic, llama3)")
    return inv


class Rotary(nn.Module):
    """Cos/sin tables for RoPE; recomputes frequencies per sequence for dynamic NTK."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.dynamic = (config.rope_scaling or {}).get("rope_type") == "dynamic"
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def cos_sin(
        self,
        positions: torch.Tensor,
        seq_len: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` [T] -> cos, sin [T, head_dim] (Hugging Face half-rotation layout)."""
        inv = self.inv_freq
        if self.dynamic and seq_len is not None and seq_len > self.config.max_position_embeddings:
            inv = rope_inv_freq(self.config, seq_len).to(inv.device)
        ang = positions.to(torch.float32)[:, None] * inv[None, :]
        emb = torch.cat((ang, ang), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] by cos/sin [T, head_dim]."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


# ----------------------------------------------------------------------------- blocks


class RMSNorm(nn.Module):
    """Root-mean-square norm (computed in float32, like the reference)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


MLP_ACTS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class MLP(nn.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)); act = SiLU (SwiGLU) by default."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)
        self.act = MLP_ACTS[c.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def pad_groups(
    lengths: Sequence[int], min_size: int = 8, max_waste: float = 0.3
) -> list[list[int]]:
    """Split items into groups padded to their longest member (indices, longest first).

    Items are sorted by length; a group is closed once it has ``min_size`` members and
    adding the next item would pad more than ``max_waste`` of the group's slots. Few
    groups keep the per-group kernel count low; the waste cap bounds padded work.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    cur: list[int] = []
    width = total = 0
    for i in order:
        n = lengths[i]
        slots = width * (len(cur) + 1)
        if cur and len(cur) >= min_size and slots - (total + n) > max_waste * slots:
            groups.append(cur)
            cur, total = [], 0
        if not cur:
            width = n
        cur.append(i)
        total += n
    if cur:
        groups.append(cur)
    return groups


@dataclass
class DecodeGroup:
    """Decode sequences attended together: keys gathered block-wise, padded to ``width`` blocks."""

    rows: torch.Tensor  # [G] packed row of each sequence's query
    blocks: torch.Tensor  # [G * width] block ids (padding: block 0, masked)
    bias: torch.Tensor  # [G, width * block_size] 0 for valid keys, -inf for padding
    width: int


@dataclass
class PrefillGroup:
    """Fresh prefills (no cached prefix) attended together, padded to ``length`` tokens."""

    gather: torch.Tensor  # [G * length] packed rows (padding: row 0)
    valid: torch.Tensor  # [n valid] positions in the padded [G * length] layout
    rows: torch.Tensor  # [n valid] packed rows they map to
    length: int


@dataclass
class PagedBatch:
    """Metadata of one packed serving batch (all tensors on the model's device).

    Tokens of every sequence are concatenated: sequence ``i`` contributes
    ``query_lens[i]`` new tokens at positions ``context_lens[i] - query_lens[i] ...
    context_lens[i] - 1``. ``slot_mapping[t]`` is the KV slot (``block * block_size +
    offset``) where token ``t``'s key/value is written; ``block_tables[i]`` lists the
    blocks of sequence ``i`` in order.

    :meth:`prepare` builds, once per batch, the index tensors every layer reuses: decode
    sequences in padded groups that gather whole KV blocks (no per-sequence loop),
    fresh prefills in padded causal groups, and only chunked prefills after a cached
    prefix one at a time.
    """

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    block_size: int
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefill_groups: list[PrefillGroup] = field(default_factory=list)
    chunked: list[int] = field(default_factory=list)  # sequences with a cached prefix
    starts: list[int] = field(default_factory=list)  # packed row of each sequence's first token
    _rope: dict[str, Any] = field(default_factory=dict)

    def prepare(self, rotary: Rotary) -> None:
        """Precompute RoPE tables and attention groups (shared by all layers)."""
        if self._rope:
            return
        dev = self.positions.device
        if rotary.dynamic:  # dynamic NTK: each sequence's length decides its frequencies
            cs, ss, off = [], [], 0
            for q, c in zip(self.query_lens, self.context_lens, strict=True):
                co, si = rotary.cos_sin(self.positions[off : off + q], seq_len=c)
                cs.append(co)
                ss.append(si)
                off += q
            self._rope["cos"], self._rope["sin"] = torch.cat(cs), torch.cat(ss)
        else:
            self._rope["cos"], self._rope["sin"] = rotary.cos_sin(self.positions)
        starts, off = [], 0
        for q in self.query_lens:
            starts.append(off)
            off += q
        self.starts = starts
        dec, fresh, self.chunked = [], [], []
        for i, (q, c) in enumerate(zip(self.query_lens, self.context_lens, strict=True)):
            (dec if q == 1 and c > 1 else fresh if q == c else self.chunked).append(i)
        bs = self.block_size
        nblk = [-(-self.context_lens[i] // bs) for i in dec]
        for g in pad_groups(nblk):
            seqs = [dec[j] for j in g]
            width = nblk[g[0]]
            blocks = []
            for i in seqs:
                bt = self.block_tables[i][:width]
                blocks.extend(bt)
                blocks.extend([0] * (width - len(bt)))
            ctx = torch.tensor([self.context_lens[i] for i in seqs])
            bias = torch.zeros(len(seqs), width * bs)
            bias.masked_fill_(torch.arange(width * bs)[None, :] >= ctx[:, None], float("-inf"))
            self.decode_groups.append(
                DecodeGroup(
                    torch.tensor([starts[i] for i in seqs], device=dev),
                    torch.tensor(blocks, device=dev),
                    bias.to(dev),
                    width,
                )
            )
        lens = [self.query_lens[i] for i in fresh]
        for g in pad_groups(lens):
            seqs = [fresh[j] for j in g]
            length = lens[g[0]]
            gather, valid, rows = [], [], []
            for r, i in enumerate(seqs):
                n, s0 = self.query_lens[i], starts[i]
                gather.extend(range(s0, s0 + n))
                gather.extend([0] * (length - n))
                valid.extend(range(r * length, r * length + n))
                rows.extend(range(s0, s0 + n))
            self.prefill_groups.append(
                PrefillGroup(
                    torch.tensor(gather, device=dev),
                    torch.tensor(valid, device=dev),
                    torch.tensor(rows, device=dev),
                    length,
                )
            )

    def seq_slots(self, i: int) -> torch.Tensor:
        """KV slots of positions ``0 .. context_lens[i]-1`` of sequence ``i``."""
        n, bs = self.context_lens[i], self.block_size
        pos = torch.arange(n, device=self.positions.device)
        bt = torch.tensor(self.block_tables[i], dtype=torch.int64, device=pos.device)
        return bt[pos // bs] * bs + pos % bs


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
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
        cos_f, sin_f = cos.repeat(b, 1), sin.repeat(b, 1)
        q = apply_rope(q, cos_f, sin_f).view(b, s, self.nq, self.hd).transpose(1, 2)
        k = apply_rope(k, cos_f, sin_f).view(b, s, self.nkv, self.hd).transpose(1, 2)
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
    ) -> torch.Tensor:
        """Packed attention over a paged cache.

        x [T, H]; k_cache / v_cache [num_slots, n_kv_heads, head_dim] (written in place).
        """
        t = x.shape[0]
        nq, nkv, hd = self.nq, self.nkv, self.hd
        rep = nq // nkv
        cos, sin = batch._rope["cos"], batch._rope["sin"]
        q = apply_rope(self.q_proj(x).view(t, nq, hd), cos, sin)
        k = apply_rope(self.k_proj(x).view(t, nkv, hd), cos, sin)
        v = self.v_proj(x).view(t, nkv, hd)
        k_cache.index_copy_(0, batch.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, batch.slot_mapping, v.to(v_cache.dtype))
        out = torch.empty(t, nq, hd, dtype=x.dtype, device=x.device)
        bs = batch.block_size
        kb = k_cache.view(-1, bs, nkv, hd)
        vb = v_cache.view(-1, bs, nkv, hd)
        for g in batch.decode_groups:  # one query per sequence: [G, nkv, rep, hd]
            n, length = g.rows.numel(), g.width * bs
            qd = q.index_select(0, g.rows).view(n, nkv, rep, hd)
            kd = kb.index_select(0, g.blocks).view(n, length, nkv, hd).to(x.dtype)
            vd = vb.index_select(0, g.blocks).view(n, length, nkv, hd).to(x.dtype)
            s = torch.matmul(qd, kd.permute(0, 2, 3, 1)) * self.scale  # [G, nkv, rep, L]
            p = torch.softmax(s + g.bias.to(s.dtype)[:, None, None, :], dim=-1)
            od = torch.matmul(p, vd.transpose(1, 2))  # [G, nkv, rep, hd]
            out.index_copy_(0, g.rows, od.reshape(n, nq, hd))
        for g in batch.prefill_groups:  # fresh prompts: causal over their own tokens
            n, ln = g.gather.numel() // g.length, g.length
            qp = q.index_select(0, g.gather).view(n, ln, nq, hd).transpose(1, 2)
            kp = k.index_select(0, g.gather).view(n, ln, nkv, hd).transpose(1, 2)
            vp = v.index_select(0, g.gather).view(n, ln, nkv, hd).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, scale=self.scale, enable_gqa=rep > 1
            )
            o = o.transpose(1, 2).reshape(n * ln, nq, hd).index_select(0, g.valid)
            out.index_copy_(0, g.rows, o)
        for i in batch.chunked:  # chunk after a cached prefix: query j sees keys <= n - ql + j
            ql, s0, n = batch.query_lens[i], batch.starts[i], batch.context_lens[i]
            slots = batch.seq_slots(i)
            ks = k_cache[slots].to(x.dtype).transpose(0, 1)[None]  # [1, nkv, n, hd]
            vs = v_cache[slots].to(x.dtype).transpose(0, 1)[None]
            qs = q[s0 : s0 + ql].transpose(0, 1)[None]  # [1, nq, ql, hd]
            qpos = torch.arange(n - ql, n, device=x.device)[:, None]
            kpos = torch.arange(n, device=x.device)[None, :]
            mask = (kpos <= qpos)[None, None]
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, scale=self.scale, enable_gqa=rep > 1
            )
            out[s0 : s0 + ql] = o[0].transpose(0, 1)
        return self.o_proj(out.reshape(t, nq * hd))


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
        x = x + self.self_attn.forward_paged(self.input_layernorm(x), batch, kc, vc)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        return self.lm_head(hidden)

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


# ----------------------------------------------------------------------------- checkpoints


def read_config(path: str | Path) -> LlamaConfig:
    """Read and check ``config.json`` of a Hugging Face Llama checkpoint directory.

    An unsupported setting raises :class:`~convergent.errors.ConfigError` (see
    :func:`convergent.models.hf_check.check_supported`); Mistral's ``sliding_window`` is
    honoured by capping the context at the window (:attr:`LlamaConfig.max_context`), or ignored when
    ``use_sliding_window`` is false.
    """
    from convergent.errors import ConfigError
    from convergent.models.hf_check import check_supported

    p = Path(path)
    cfg_file = p / "config.json" if p.is_dir() else p
    try:
        with open(cfg_file, encoding="utf-8") as fh:
            d = json.load(fh)
    except json.JSONDecodeError as exc:
        from convergent.errors import InputError, parse_error_text

        raise InputError(parse_error_text(cfg_file, "JSON", exc)) from None
    if not isinstance(d, dict):
        raise ConfigError(f"{cfg_file}: not a JSON object")
    check_supported(d, str(cfg_file))
    if d.get("use_sliding_window") is False:
        d = {**d, "sliding_window": None}
    try:
        return LlamaConfig.from_hf_dict(d)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{cfg_file}: {exc}") from None


def load_pretrained(
    path: str | Path,
    layers: Iterable[int] | None = None,
    embed: bool = True,
    head: bool = True,
    dtype: torch.dtype = torch.float32,
) -> LlamaForCausalLM:
    """Load a Hugging Face Llama checkpoint directory (``config.json`` + ``*.safetensors``).

    Only the tensors this (possibly partial) model holds are read. Raises
    ``FileNotFoundError`` / ``KeyError`` on a missing file or tensor.
    """
    from safetensors import safe_open

    p = Path(path)
    config = read_config(p)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, layers, embed, head)
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{p}: no *.safetensors file")
    wanted = {n for n, _ in model.named_parameters()}
    if head and config.tie_word_embeddings:
        wanted.add("lm_head.weight")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                if key in wanted:
                    state[key] = fh.get_tensor(key).to(dtype)
                elif key == "model.embed_tokens.weight" and head and config.tie_word_embeddings:
                    state["lm_head.weight"] = fh.get_tensor(key).to(dtype)
    if head and config.tie_word_embeddings and "lm_head.weight" not in state:
        if "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing = sorted(n for n, _ in model.named_parameters() if n not in state)
    if missing:
        raise KeyError(f"{p}: tensors missing from the checkpoint: {', '.join(missing[:5])}")
    model.load_state_dict(state, strict=False, assign=True)
    if head and embed and config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary = Rotary(config)  # buffers were created on meta
    return model.eval()


def save_pretrained(model: LlamaForCausalLM, path: str | Path) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the Hugging Face layout."""
    from safetensors.torch import save_file

    from convergent.fsutil import atomic_write_text

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tmp = p / ".model.safetensors.partial"
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(p / "model.safetensors")
    atomic_write_text(p / "config.json", json.dumps(model.config.to_hf_dict(), indent=2))
    return p
