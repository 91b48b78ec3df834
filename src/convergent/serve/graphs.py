"""Which decode path a stage takes (``serve.engine.cuda_graphs``) and building it.

``auto`` captures CUDA graphs of the decode steps on CUDA where the decode attention is
one the static path supports (:data:`~convergent.models.paged_graphs.GRAPH_BACKENDS`) and
the RoPE is not dynamic NTK; ``on`` insists (a ConfigError where it cannot) and on the
CPU runs the padded static-buffer path without capture (the check of its padding that
runs without a GPU); ``off`` keeps every step eager. The other steps (prefills, chunks
and decodes together) take the piecewise runner of :mod:`convergent.models.paged_pieces`
in the same mode (graphs of each layer's dense work per token bucket, the attention eager
between them) unless ``serve.engine.mixed_graphs=off``; steps past its largest bucket
(``serve.scheduler.max_batched_tokens``) stay eager.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from convergent.core.errors import ConfigError
from convergent.models.paged_compiled import CompiledDecode
from convergent.models.paged_graphs import GRAPH_BACKENDS, DecodeGraphs, GraphShape
from convergent.models.paged_pieces import MixedGraphs

if TYPE_CHECKING:
    import torch

    from convergent.models.llama_config import LlamaConfig
    from convergent.serve.config import EngineConfig

__all__ = ["GraphMode", "build_compiled", "build_graphs", "build_mixed_graphs", "graph_mode"]

GraphMode = Literal["capture", "static", "off"]


def graph_mode(eng: EngineConfig, device: torch.device | str, backend: str,
               dynamic_rope: bool) -> GraphMode:
    """``capture`` (CUDA graphs), ``static`` (the padded path, no capture) or ``off``."""
    import torch

    if eng.cuda_graphs == "off":
        return "off"
    cuda = torch.device(device).type == "cuda"
    why = None
    if backend not in GRAPH_BACKENDS:
        why = f"serve.engine.attention_backend={backend} (graphs take {', '.join(GRAPH_BACKENDS)})"
    elif dynamic_rope:
        why = "dynamic-NTK RoPE (its tables depend on each sequence's length)"
    if why is None:
        return "capture" if cuda else ("static" if eng.cuda_graphs == "on" else "off")
    if eng.cuda_graphs == "on":
        raise ConfigError(f"serve.engine.cuda_graphs=on: not with {why}",
                          hint="set serve.engine.cuda_graphs=auto or off")
    return "off"


def build_graphs(model, kv, mcfg: LlamaConfig, eng: EngineConfig, *, mode: GraphMode,
                 num_blocks: int, max_num_seqs: int, backend: str, first: bool, last: bool,
                 dtype, device) -> DecodeGraphs | None:
    """The stage's decode runner (``None`` when ``mode`` is off), captured in
    ``capture`` mode. ``kv`` holds ``num_blocks + 1`` blocks: the last is the padding
    rows' scratch block."""
    if mode == "off":
        return None
    longest = min(eng.max_model_len, mcfg.max_context, num_blocks * eng.block_size)
    shape = GraphShape(
        max_seqs=min(eng.cuda_graph_max_seqs or max_num_seqs, max_num_seqs),
        max_blocks=-(-longest // eng.block_size),
        block_size=eng.block_size,
        scratch_block=num_blocks,
    )
    graphs = DecodeGraphs(model, kv, shape, backend, first=first, last=last, dtype=dtype,
                          device=device)
    if mode == "capture":
        graphs.capture()
    return graphs


def build_mixed_graphs(model, kv, eng: EngineConfig, *, mode: GraphMode, max_tokens: int,
                       first: bool, dtype, device) -> MixedGraphs | None:
    """The stage's piecewise runner of the mixed steps (``None`` when ``mode`` is off or
    ``serve.engine.mixed_graphs`` is), captured in ``capture`` mode."""
    if mode == "off" or eng.mixed_graphs == "off":
        return None
    runner = MixedGraphs(model, kv, max_tokens, first=first, dtype=dtype, device=device)
    if mode == "capture":
        runner.capture()
    return runner


def build_compiled(model, kv, eng: EngineConfig, *, first: bool, last: bool,
                   scratch_block: int) -> CompiledDecode | None:
    """The stage's compiled decode step (``serve.engine.compile=decode``, a CPU float32
    stage; the config refuses it elsewhere), compiled here, before the first request;
    ``None`` when off. ``kv`` holds ``scratch_block + 1`` blocks: the warm-up writes only
    the last."""
    if eng.compile == "off":
        return None
    import torch

    if model.model.rotary.dynamic:
        raise ConfigError("serve.engine.compile=decode: not with dynamic-NTK RoPE (its tables "
                          "depend on each sequence's length)", hint="set serve.engine.compile=off")
    comp = CompiledDecode(model, kv, first=first, last=last, block_size=eng.block_size,
                          scratch_block=scratch_block)
    comp.warm_up(torch.float32)
    return comp
