"""INT8 quantisation of ``nn.Linear`` (and embedding) layers for CPU/GPU inference.

Two methods, recorded as :class:`QuantInfo` in the checkpoints that carry them:

* ``int8`` — **weight-only INT8**, symmetric, one scale per output channel
  (``w ~= q * scale[out]``, ``q`` in [-127, 127]). :class:`Int8Linear` keeps ``q`` (int8)
  and ``scale`` (fp32); for bf16/fp16 activations its forward uses torch's int8-weight
  matmul kernel (``torch._weight_int8pack_mm``, CPU and CUDA) when no gradient is
  needed; otherwise (fp32, or autograd) it dequantises on the fly and runs the float
  GEMM (so autograd forces of the surrogate, ``-dE/dpositions``, flow through it). The
  fp32 CPU path therefore saves memory, not time. Embedding tables get one scale per row (:class:`Int8Embedding`).
  Weights take ~1/4 of their fp32 memory; activations stay in the model's dtype.
* ``int8-dynamic`` — torch's **dynamic INT8** (``torch.ao.quantization.quantize_dynamic``,
  per-channel weights, activations quantised per batch at run time, fbgemm/x86 or
  qnnpack kernels). CPU and fp32 only, no autograd through it; torch marks the
  ``torch.ao`` eager API deprecated in favour of torchao (not installed here), and its
  deprecation warning is silenced around the call.

FP8 / INT4: torch 2.13's CPU build has no FP8 matmul and the INT4 weight kernel
(``_weight_int4pack_mm``) needs a packed layout per device; neither is offered here.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from convergent.core.errors import ConfigError

__all__ = [
    "METHODS",
    "Int8Embedding",
    "Int8Linear",
    "QuantInfo",
    "quantize",
    "quantize_dynamic_int8",
    "quantize_per_channel",
    "quantize_weight_only",
    "weight_bytes",
]

METHODS = ("none", "int8", "int8-dynamic")


@dataclass
class QuantInfo:
    """What was quantised and how (stored in checkpoint metadata)."""

    method: str  # "int8" | "int8-dynamic"
    granularity: str = "per-output-channel"  # rows of the weight for embeddings
    symmetric: bool = True
    bits: int = 8
    modules: list[str] = field(default_factory=list)  # qualified names quantised
    skipped: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantInfo:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 of a 2-D weight, one fp32 scale per row: ``(q int8, scale)``."""
    w = w.detach().float()
    amax = w.abs().amax(dim=1).clamp_min(1e-12)
    scale = amax / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """``nn.Linear`` with INT8 weights and per-output-channel fp32 scales."""

    def __init__(self, in_features: int, out_features: int, bias: bool, device: Any = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.empty(out_features, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> Int8Linear:
        m = cls(lin.in_features, lin.out_features, lin.bias is not None, device=lin.weight.device)
        q, s = quantize_per_channel(lin.weight)
        m.qweight.copy_(q)
        m.scale.copy_(s)
        if lin.bias is not None:
            m.bias.data = lin.bias.detach().clone()
        return m

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.qweight.to(dtype) * self.scale.to(dtype)[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's int8-weight kernel is fast for bf16/fp16 activations (and, measured here,
        # ~10x slower than dequantise + fp32 GEMM for fp32 ones on CPU)
        if not (torch.is_grad_enabled() and x.requires_grad) and x.dtype in (
            torch.bfloat16, torch.float16
        ):
            shape = x.shape
            y = torch._weight_int8pack_mm(
                x.reshape(-1, shape[-1]).contiguous(), self.qweight, self.scale.to(x.dtype)
            ).reshape(*shape[:-1], self.out_features)
        else:
            y = F.linear(x, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


class Int8Embedding(nn.Module):
    """``nn.Embedding`` with INT8 rows and one fp32 scale per row."""

    def __init__(self, num: int, dim: int, device: Any = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.out_dtype = num, dim, dtype
        self.register_buffer("qweight", torch.empty(num, dim, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.empty(num, dtype=torch.float32, device=device))

    @classmethod
    def from_embedding(cls, emb: nn.Embedding) -> Int8Embedding:
        m = cls(emb.num_embeddings, emb.embedding_dim, emb.weight.device, emb.weight.dtype)
        q, s = quantize_per_channel(emb.weight)
        m.qweight.copy_(q)
        m.scale.copy_(s)
        return m

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.qweight).to(self.out_dtype)
        return rows * self.scale[ids].unsqueeze(-1).to(self.out_dtype)


def _children(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Module]]:
    """``(qualified name, parent, attribute, module)`` of every submodule."""
    out = []
    for pname, parent in model.named_modules():
        for attr, child in parent.named_children():
            out.append((f"{pname}.{attr}" if pname else attr, parent, attr, child))
    return out


def quantize_weight_only(
    model: nn.Module, embeddings: bool = True, skip: tuple[str, ...] = (),
    only: set[str] | None = None,
) -> QuantInfo:
    """Replace, in place, every ``nn.Linear`` (and ``nn.Embedding`` when ``embeddings``)
    whose qualified name contains none of ``skip`` (and is in ``only`` when given) by its
    INT8 version. On a ``meta``-device model this builds the structure only (loading)."""
    info = QuantInfo("int8")
    done: dict[int, nn.Module] = {}  # tied weights: one INT8 copy for both users
    for name, parent, attr, child in _children(model):
        if not isinstance(child, nn.Linear | nn.Embedding):
            continue
        if (any(s in name for s in skip) or (isinstance(child, nn.Embedding) and not embeddings)
                or (only is not None and name not in only)):
            info.skipped.append(name)
            continue
        key = id(child.weight)
        if isinstance(child, nn.Linear):
            new = Int8Linear.from_linear(child)
            if key in done and isinstance(done[key], Int8Embedding):
                new.qweight, new.scale = done[key].qweight, done[key].scale
        else:
            new = Int8Embedding.from_embedding(child)
            if key in done and isinstance(done[key], Int8Linear):
                new.qweight, new.scale = done[key].qweight, done[key].scale
        done[key] = new
        setattr(parent, attr, new)
        info.modules.append(name)
    return info


def quantize_dynamic_int8(model: nn.Module, skip: tuple[str, ...] = ()) -> tuple[nn.Module, QuantInfo]:
    """torch's dynamic INT8 of the ``nn.Linear`` layers (CPU, fp32 activations).

    Returns ``(quantised model, info)``; the input model is left unchanged.
    """
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ConfigError("quantize=int8-dynamic runs on CPU only (torch's fbgemm/qnnpack kernels)")
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ConfigError("quantize=int8-dynamic needs float32 weights (dtype=float32)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        spec = {n: per_channel_dynamic_qconfig for n in names if not any(s in n for s in skip)}
        qmodel = quantize_dynamic(model, spec, dtype=torch.qint8, inplace=False)
    info = QuantInfo("int8-dynamic", modules=sorted(spec), skipped=sorted(set(names) - set(spec)))
    return qmodel, info


def quantize(model: nn.Module, method: str, **kw: Any) -> tuple[nn.Module, QuantInfo | None]:
    """Apply ``method`` (one of :data:`METHODS`); returns ``(model, info or None)``."""
    if method == "none":
        return model, None
    if method == "int8":
        return model, quantize_weight_only(model, **kw)
    if method == "int8-dynamic":
        kw.pop("embeddings", None)
        return quantize_dynamic_int8(model, **kw)
    raise ConfigError(f"quantize={method!r} is not one of {', '.join(METHODS)}")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as stored in memory (parameters and int8 buffers,
    each tied tensor once; packed dynamic-INT8 weights counted as int8 + scales)."""
    seen: set[int] = set()
    total = 0
    for m in model.modules():
        tensors = list(m.parameters(recurse=False))
        if isinstance(m, Int8Linear | Int8Embedding):
            tensors += [m.qweight, m.scale]
        packed = getattr(m, "_packed_params", None)
        if packed is not None and hasattr(m, "weight") and callable(m.weight):
            w = m.weight()
            total += w.numel() + 4 * w.shape[0] + (m.bias().numel() * 4 if m.bias() is not None else 0)
        for t in tensors:
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
