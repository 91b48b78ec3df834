"""Rotary position embeddings of the Llama family: default / linear / dynamic NTK / llama3
frequencies, the cos/sin tables and the rotation (Hugging Face half-rotation layout)."""

from __future__ import annotations

import math

import torch
from torch import nn

from convergent.models.llama_config import LlamaConfig

__all__ = ["Rotary", "apply_rope_signed", "rope_inv_freq", "signed_sin"]


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


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` [T, head_dim] with its first half negated: the sign of the half rotation
    folded into the table (for :func:`apply_rope_signed`)."""
    h = sin.shape[-1] // 2
    return torch.cat((-sin[:, :h], sin[:, h:]), dim=-1)


def apply_rope_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] by RoPE (Hugging Face's half-rotation layout:
    ``x * cos + rotate_half(x) * sin``, ``rotate_half(x) = cat(-x2, x1)``), with the sign of
    the half rotation folded into the table, ``sin_signed = signed_sin(sin)``: the rolled
    halves times the signed table equal ``rotate_half(x) * sin`` bit for bit (a product
    with a negated factor is the negated product), in one kernel fewer. The one RoPE of
    the dense and the serving forward (serving builds the table once per batch, every
    layer reuses it)."""
    rot = x.roll(x.shape[-1] // 2, dims=-1).mul_(sin_signed[:, None, :])
    return rot.add_(x * cos[:, None, :])  # a + b == b + a, bit for bit
