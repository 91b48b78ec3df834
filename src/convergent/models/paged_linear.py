"""The serving forward's projections: fused at load time and, on the CPU, prepacked.

:func:`fuse_for_serving` gives every decoder layer of a loaded model one query-key-value
projection and one gate-up projection (the weights concatenated along the output
dimension, one GEMM instead of three / two), and the output, down and LM-head
projections beside them, as :class:`ServingLinear` (typed: :class:`AttentionProjections`,
:class:`MLPProjections`). The output and down projections take the residual stream and
add it in the GEMM's epilogue (oneDNN's ``add`` post-op on a prepacked weight; exact in
float32: the accumulator is float32 and rounded once). On the CPU in float32 each weight is
also reordered once into oneDNN's blocked layout (``torch.ops.mkldnn``, the layout its
GEMM reads without repacking per call, chosen for :data:`PACK_ROWS` rows): for the small
row counts of decode steps (a few to a few dozen tokens) that GEMM runs 1.3-2x faster
than ``F.linear`` on the plain weight. The layer's ``nn.Linear`` modules are kept (the
dense forward, training and ``state_dict`` use them) unless ``release`` (a serving stage:
each weight held once); :meth:`LlamaModel.forward_paged` uses the fused ones when present.
Only plain float ``nn.Linear`` layers are fused (an INT8 model keeps its own).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["AttentionProjections", "MLPProjections", "ServingLinear", "fuse_for_serving",
           "packed_gemm_available"]


# the row count oneDNN lays a prepacked weight out for (its blocked layout depends on it):
# on 2 cores the GEMMs of a 30M Llama's 10 layers at 8-64 rows took 0.86-0.98x the time of
# weights packed without a count, at 1 row the same
PACK_ROWS = 32


def packed_gemm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights on ``device`` in ``dtype`` can be prepacked for oneDNN's GEMM."""
    return (device.type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class ServingLinear(nn.Module):
    """``y = x @ W.T (+ b)`` with ``W`` the row-concatenation of ``linears``' weights;
    prepacked for oneDNN when :func:`packed_gemm_available` (else ``F.linear``). A plain
    ``weight`` and the ``bias`` are buffers that are not saved (the ``state_dict`` keeps
    the layer's own linears), so a compiled forward sees them as the module's constants
    (:mod:`convergent.models.paged_compiled` freezes them); the packed copy is a plain
    attribute (an opaque oneDNN tensor). A packed layer keeps its plain weight too only
    with ``keep_plain`` (for a compiled forward, which reads the plain one; the eager one
    reads the packed)."""

    def __init__(self, linears: list[nn.Linear], pack: bool = True,
                 keep_plain: bool = False) -> None:
        super().__init__()
        with torch.no_grad():
            w = torch.cat([m.weight.detach() for m in linears]).contiguous()
            has_bias = [m.bias is not None for m in linears]
            b = (torch.cat([m.bias.detach() for m in linears]).contiguous()
                 if all(has_bias) else None)
        if any(has_bias) and b is None:
            raise ValueError("fusing linears of which only some have a bias")
        self.out_features = w.shape[0]
        self.register_buffer("bias", b, persistent=False)
        self.packed = None
        if pack and packed_gemm_available(w.device, w.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
            w = w if keep_plain else None  # the packed copy is the one read
        self.register_buffer("weight", w, persistent=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T (+ b)``, plus ``residual`` [.., out_features] when given (fused into
        the prepacked GEMM)."""
        if self.packed is not None and not torch.compiler.is_compiling():
            if residual is not None:
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed,
                                                                  self.bias, "add")
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        y = F.linear(x, self.weight, self.bias)
        return y if residual is None else residual + y


class AttentionProjections(nn.Module):
    """An attention layer's serving projections: fused query-key-value, and output."""

    def __init__(self, qkv: ServingLinear, o: ServingLinear) -> None:
        super().__init__()
        self.qkv, self.o = qkv, o


class MLPProjections(nn.Module):
    """An MLP's serving projections: fused gate-up (gate rows first), and down."""

    def __init__(self, gate_up: ServingLinear, down: ServingLinear) -> None:
        super().__init__()
        self.gate_up, self.down = gate_up, down


def _plain(*mods: nn.Module | None) -> bool:
    return all(type(m) is nn.Linear and m.weight.is_floating_point() for m in mods)


def _fuse(linears: list[nn.Linear], pack: bool, release: bool,
          keep_plain: bool = False) -> ServingLinear:
    """One :class:`ServingLinear` of ``linears``; with ``release`` the modules keep no
    copy of their own: each weight becomes a view of the fused plain weight, or, where
    that was packed, an empty tensor (the packed copy is then the only one)."""
    s = ServingLinear(linears, pack, keep_plain)
    if release:
        off = 0
        for m in linears:
            n = m.weight.shape[0]
            w = s.weight[off:off + n] if s.weight is not None else m.weight.new_empty(0)
            m.weight = nn.Parameter(w, requires_grad=False)
            off += n
    return s


def fuse_for_serving(model: nn.Module, pack: bool = True, release: bool = False,
                     keep_plain: bool = False) -> int:
    """Attach the fused projections to ``model`` (a ``LlamaForCausalLM``, whole or one
    stage) as submodules ``serving`` of each attention and MLP and ``serving_head`` of
    the model (their buffers are not saved: the ``state_dict`` is unchanged); returns how
    many layers were fused. Call it again after the weights change. ``release`` (a serving stage, which runs only the serving
    forward): the fused modules give up their own weights, so the stage holds each
    weight once (views of the fused weight, or only the packed copy; their dense forward
    and ``state_dict`` are then unusable); a head tied to the embedding keeps its own.
    ``keep_plain``: packed layers keep their plain weight as well (for a compiled forward:
    twice the weights' memory)."""
    n = 0
    fuse = lambda mods: _fuse(mods, pack, release, keep_plain)  # noqa: E731
    for layer in model.model.layers.values():
        at, mlp = layer.self_attn, layer.mlp
        if not _plain(at.q_proj, at.k_proj, at.v_proj, at.o_proj, mlp.gate_proj, mlp.up_proj,
                      mlp.down_proj):
            continue
        at.serving = AttentionProjections(fuse([at.q_proj, at.k_proj, at.v_proj]),
                                          fuse([at.o_proj]))
        mlp.serving = MLPProjections(fuse([mlp.gate_proj, mlp.up_proj]), fuse([mlp.down_proj]))
        n += 1
    head = getattr(model, "lm_head", None)
    if head is None or not _plain(head):
        model.serving_head = None
        return n
    embed = getattr(model.model, "embed_tokens", None)
    tied = embed is not None and head.weight is embed.weight
    model.serving_head = _fuse([head], pack, release and not tied, keep_plain)
    return n
