"""Hyper-parameters of a Llama-architecture decoder (Hugging Face ``config.json`` names) and
the gated-MLP activations it implements."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch.nn.functional as F

__all__ = ["LlamaConfig", "MLP_ACTS"]

MLP_ACTS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


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
