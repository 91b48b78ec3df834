"""Decode steps of a CPU float32 stage as one compiled graph (``serve.engine.compile=decode``).

On the CPU a small decode step is bound by the host, not by its GEMMs: measured on 2
cores (docs/serving.md), a 30M Llama's eager step makes ~400 ATen calls of 10-15 µs, and
the same engine on a 10-layer Llama of hidden size 64, whose arithmetic is negligible,
still takes ~5 ms a step. :class:`CompiledDecode` runs a pure decode step (one new token
per sequence, one padded decode group) as one ``torch.compile`` graph instead: the very
same forward (:meth:`~convergent.models.llama_model.LlamaModel.forward_paged`, the LM head
on the last stage) over a :class:`DecodeStep`, a batch of tensors only, whose attention is
:func:`~convergent.models.llama_paged.bmm_attention` (the eager CPU kernel's GEMMs,
written in ATen so that Inductor sees it). Inductor fuses the norms, RoPE, the
activation and the residual adds into a few C++ loops, and with ``freezing`` it folds the
weights (the serving projections' buffers, :mod:`convergent.models.paged_linear`) into
constants and packs them for oneDNN's GEMM (the residual add in its epilogue). The
sequence count and the context width are dynamic, so one graph serves every step (a step of
one sequence or of a one-block context is padded to two: dynamo specializes sizes of 1; the
padding row writes a scratch KV block the block manager never hands out). It is compiled at
start-up (:meth:`CompiledDecode.warm_up`), ~20-30 s on 2 cores cold, less from Inductor's
cache on disk; after that the steps call it without evaluating its guards
(``skip_guard_eval_unsafe``: :meth:`CompiledDecode.run` builds every input the same way, so
they hold; 0.4 ms of a ~7 ms step on 2 cores).

The compiled step computes what the eager one does in float32 up to rounding (fused
loops sum in another order): the tests compare its logits and KV writes with the eager
forward's within float32's tolerance. Prefills, chunks and mixed steps stay eager.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from convergent.models.llama_paged import (
    DecodeGroup,
    PagedBatch,
    bmm_attention,
    bmm_layout,
    write_kv,
)
from convergent.models.llama_rope import signed_sin

__all__ = ["CompiledDecode", "DecodeStep"]


def _FREEZING():  # noqa: N802
    """Inductor's freezing, for the compilations inside (the weights become constants,
    prepacked for oneDNN's GEMM with its add epilogue; measured: the option passed to
    ``torch.compile`` did not reach the lowering, the patched config does)."""
    import torch._inductor.config as inductor

    return inductor.patch(freezing=True)


@dataclass
class DecodeStep:
    """A pure decode step as tensors only (what a compiled graph takes): one query per
    sequence, its RoPE tables, KV slots, and the decode group's :func:`bmm_layout`."""

    cos: torch.Tensor  # [n, head_dim]
    sin_signed: torch.Tensor  # [n, head_dim]
    slot_mapping: torch.Tensor  # [n] where each new key / value goes
    rows: torch.Tensor  # [n] packed row of each sequence of the group
    kv_rows: torch.Tensor  # bmm_layout
    bias: torch.Tensor  # [n * nkv, rep, keys]

    def prepare(self, rotary: nn.Module) -> None:
        """Nothing: the tables are the step's (the batch interface of ``forward_paged``)."""

    def rope(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos.to(dtype), self.sin_signed.to(dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, self.slot_mapping)
        o = bmm_attention(q.index_select(0, self.rows), k_cache, v_cache, self.kv_rows,
                          self.bias, scale)
        return torch.empty_like(o).index_copy_(0, self.rows, o)


class _DecodeForward(nn.Module):
    """The compiled module: a stage's forward over a :class:`DecodeStep` (hidden states,
    or on the last stage float32 logits of every row). Its inputs are a step's tensors
    whose sizes are the sequences ``n`` and the widest context's blocks ``width`` only (so
    that every size of the graph is a function of those two): the mask and the KV layout
    are made inside it, from the block ids and the positions."""

    def __init__(self, model: nn.Module, last: bool, block_size: int) -> None:
        super().__init__()
        self.model = model
        self.last = last
        c = model.config
        self.block_size, self.nkv = block_size, c.num_key_value_heads
        self.rep = c.num_attention_heads // c.num_key_value_heads

    def forward(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                rows: torch.Tensor, blocks: torch.Tensor,
                kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        n, width = blocks.shape  # the group's sequences, in the order of rows
        keys = torch.arange(width * self.block_size, device=blocks.device)
        ctx = positions.index_select(0, rows) + 1  # a decode's context ends at its token
        bias = torch.zeros(n, keys.shape[0], device=blocks.device).masked_fill_(
            keys[None, :] >= ctx[:, None], float("-inf"))
        kv_rows, bias_bmm = bmm_layout(blocks.reshape(-1), bias, width, self.block_size,
                                       self.nkv, self.rep)
        body = self.model.model
        cos, sin = body.rotary.cos_sin(positions)
        step = DecodeStep(cos, signed_sin(sin), slots, rows, kv_rows, bias_bmm)
        h = body.forward_paged(x, step, kv)
        return self.model.logits(h).float() if self.last else h


class CompiledDecode:
    """The compiled decode path of one stage (``model``: its fused ``LlamaForCausalLM``
    slice; ``kv``: its layers' caches, the last block a scratch block)."""

    def __init__(self, model: nn.Module, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
                 first: bool, last: bool, block_size: int, scratch_block: int) -> None:
        self.kv = list(kv)
        self.first, self.block_size, self.scratch = first, block_size, scratch_block
        self.hidden = model.config.hidden_size
        self.steps = 0  # decode steps run compiled
        self.warm = False  # compiled (by warm_up)
        # each instance compiles its own graphs (their constants are its weights): let a
        # process hold more than dynamo's default 8 (engines made one after another)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.fn = torch.compile(_DecodeForward(model, last, block_size).eval())

    @staticmethod
    def fits(batch: PagedBatch) -> bool:
        """Whether ``batch`` is a step this path runs: decodes only, in one group."""
        return (len(batch.decode_groups) == 1 and not batch.prefill_groups
                and not batch.chunked and batch.decode is None)

    def run(self, x: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """``batch``'s forward (a step that :meth:`fits`): x is the token ids (first stage)
        or the hidden states; hidden states, or on the last stage the logits of every row."""
        g = batch.decode_groups[0]
        n = g.rows.shape[0]
        blocks = g.blocks.view(n, g.width)
        if g.width == 1:  # a second block, past every context: masked
            blocks = blocks.repeat(1, 2)
        args = [x, batch.positions, batch.slot_mapping, g.rows, blocks]
        if n == 1:  # a padding row: the sequence again, writing the scratch slot
            args = [a.repeat(2, *[1] * (a.dim() - 1)) for a in args]
            args[2][1] = self.scratch * self.block_size
            args[3] = torch.arange(2, device=x.device)
        else:  # fresh tensors of the caller's mode (an inference tensor or not: dynamo
            # guards on it; the step's are views of buffers made outside inference mode)
            args = [a.clone() for a in args]
        for a in args:  # one graph: any n >= 2, any width >= 2 (dynamo specializes 1)
            torch._dynamo.mark_dynamic(a, 0)
        torch._dynamo.mark_dynamic(args[4], 1)
        self.steps += 1
        if self.warm:  # the one graph is compiled: run it without evaluating its guards
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                out = self.fn(*args, self.kv)
        else:
            with _FREEZING():  # read when a call compiles
                out = self.fn(*args, self.kv)
        return out[:1] if n == 1 else out

    def warm_up(self, dtype: torch.dtype) -> None:
        """Compile the graph (call it as the steps will be: in inference mode) on a step
        that writes and reads only the scratch block."""
        self.run(*self._scratch_step(2, dtype))
        self.steps, self.warm = 0, True

    def _scratch_step(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, PagedBatch]:
        """A decode step of ``n`` sequences of two tokens in the scratch block."""
        dev = self.kv[0][0].device
        if self.first:
            x = torch.zeros(n, dtype=torch.long, device=dev)
        else:
            x = torch.zeros(n, self.hidden, dtype=dtype, device=dev)
        bs = self.block_size
        batch = PagedBatch(
            positions=torch.ones(n, dtype=torch.long, device=dev),
            slot_mapping=torch.full((n,), self.scratch * bs + 1, dtype=torch.long,
                                    device=dev),
            query_lens=[1] * n, context_lens=[2] * n, block_tables=[[self.scratch]] * n,
            block_size=bs)
        no_bias = torch.empty(n, 0, device=dev)  # run() makes the mask from the positions
        batch.decode_groups.append(DecodeGroup(
            torch.arange(n, device=dev), torch.full((n,), self.scratch, device=dev), no_bias, 1))
        return x, batch
