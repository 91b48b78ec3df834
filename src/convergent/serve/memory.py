"""How much KV cache, and how many sequences a step, an engine takes.

``serve.engine.kv_budget_bytes`` set (non-zero): exactly that budget, as before. Left at
0: on the CPU 256 MiB (:data:`CPU_KV_BUDGET`, the earlier default); on CUDA the cache
fills the cards as vLLM's ``gpu_memory_utilization`` does, by :func:`gpu_kv_plan`:

    blocks = ((free - weights) x utilization - reserve(seqs)) / bytes per block

per stage (each stage's GPU, its own weights and layers), the pipeline taking the
smallest; ``reserve(seqs)`` is the activation memory of a step (:func:`activation_reserve`:
a fixed part plus a part per sequence, the sampled rows' logits and, on the gather path,
each decode's padded K/V copy), and ``seqs`` is ``serve.scheduler.max_num_seqs`` (256 by
default) lowered only where the card cannot hold that many sequences' reserve and a block
each. The rule itself takes numbers (:func:`gpu_kv_plan`); :func:`plan_memory` measures
them (``torch.cuda.mem_get_info`` before the stages load their weights) and applies it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from convergent.core.errors import ConfigError
from convergent.models.layersplit import split_layers

if TYPE_CHECKING:
    from convergent.models.llama_config import LlamaConfig
    from convergent.serve.config import EngineConfig, SchedulerConfig

__all__ = ["CPU_KV_BUDGET", "MemoryPlan", "activation_reserve", "gpu_kv_plan", "plan_memory",
           "stage_weight_bytes", "step_capacity"]

CPU_KV_BUDGET = 256 * 2**20  # serve.engine.kv_budget_bytes=0 on the CPU
# per GPU, beyond the step's activations: a stage process's CUDA context, cuBLAS
# workspaces and the caching allocator's fragmentation
CONTEXT_RESERVE = 1 << 30


@dataclass(frozen=True)
class MemoryPlan:
    """The engine's KV blocks and sequences per step, and where they came from."""

    num_blocks: int
    max_num_seqs: int
    kv_budget_bytes: int  # the budget the blocks were cut from (all stages)
    source: str  # the rule, in words (logged and in the summary)


def gpu_kv_plan(
    free_bytes: int,
    weight_bytes: int,
    utilization: float,
    block_bytes: int,
    fixed_reserve: int,
    per_seq_reserve: int,
    max_num_seqs: int,
) -> tuple[int, int]:
    """``(blocks, seqs)`` of one GPU: the memory left after the weights, times
    ``utilization``, less the reserve of ``seqs`` sequences, in blocks of ``block_bytes``.

    ``seqs`` is ``max_num_seqs`` unless the budget cannot hold the fixed reserve and, per
    sequence, its reserve and one block; then as many as it can. ``(0, 0)`` when not even
    one sequence fits."""
    budget = int((free_bytes - weight_bytes) * utilization) - fixed_reserve
    if budget <= 0:
        return 0, 0
    seqs = min(max_num_seqs, budget // (per_seq_reserve + block_bytes))
    if seqs < 1:
        return 0, 0
    return int((budget - seqs * per_seq_reserve) // block_bytes), int(seqs)


def stage_weight_bytes(mcfg: LlamaConfig, n_layers: int, first: bool, last: bool,
                       dtype_bytes: int, quantized: bool = False) -> int:
    """Bytes of one stage's weights: its layers (INT8 linear weights at one byte and a
    float32 scale per output channel when ``quantized``), the embedding on the first
    stage, the final norm and LM head on the last (one matrix when tied on one stage)."""
    h, i, v, hd = mcfg.hidden_size, mcfg.intermediate_size, mcfg.vocab_size, mcfg.head_dim
    nq, nkv = mcfg.num_attention_heads, mcfg.num_key_value_heads
    linear = h * hd * (2 * nq + 2 * nkv) + 3 * h * i
    rows = hd * (nq + 2 * nkv) + h + 2 * i  # output channels of the layer's linears
    per_layer = (linear + 4 * rows if quantized else linear * dtype_bytes) + 2 * h * dtype_bytes
    total = n_layers * per_layer
    if first:
        total += v * h * dtype_bytes
    if last:
        total += h * dtype_bytes
        if not (first and mcfg.tie_word_embeddings):
            total += v * h * dtype_bytes
    return total


def activation_reserve(mcfg: LlamaConfig, engine: EngineConfig, scheduler: SchedulerConfig,
                       gather: bool) -> tuple[int, int]:
    """``(fixed, per_sequence)`` bytes of a step's activations on one GPU: the hidden
    states, projections and MLP of ``max(max_batched_tokens, max_num_seqs)`` tokens (with
    a third more for padded prefill groups) plus :data:`CONTEXT_RESERVE`; per sequence
    its sampled row's logits in float32 (three copies: the dtype's, the float32 one and
    a softmax) and, on the gather path, its padded K and V copies of ``max_model_len``
    tokens (one layer at a time)."""
    b = 4 if engine.dtype == "float32" else 2
    h, i, hd = mcfg.hidden_size, mcfg.intermediate_size, mcfg.head_dim
    nq, nkv = mcfg.num_attention_heads, mcfg.num_key_value_heads
    tokens = max(scheduler.max_batched_tokens, scheduler.max_num_seqs)
    per_token = (6 * h + 2 * (nq + 2 * nkv) * hd + 3 * i) * b + 2 * hd * 4  # + RoPE tables
    fixed = int(tokens * per_token * 4 / 3) + CONTEXT_RESERVE
    per_seq = 3 * mcfg.vocab_size * 4
    if gather:
        per_seq += 2 * engine.max_model_len * nkv * hd * b
    return fixed, per_seq


def step_capacity(engine: EngineConfig, scheduler: SchedulerConfig) -> int:
    """int64 elements a step's metadata buffers start with: positions, slots, ids and the
    padded prefill indices of the token budget, each sequence's row, context and block
    table row, a chunk's slots (the buffers grow if a step needs more)."""
    tokens = max(scheduler.max_batched_tokens, scheduler.max_num_seqs)
    seqs = scheduler.max_num_seqs
    width = -(-engine.max_model_len // engine.block_size)
    return 8 * tokens + seqs * (width + 4) + 2 * engine.max_model_len


def plan_memory(engine: EngineConfig, scheduler: SchedulerConfig, mcfg: LlamaConfig,
                stages: int, backend: str) -> MemoryPlan:
    """The KV blocks and ``max_num_seqs`` of an engine (see the module's docstring);
    ``backend`` is the decode attention the stages will resolve (``sdpa_gather`` reserves
    the padded copies). A one-line ConfigError when not one block fits."""
    b = 4 if engine.dtype == "float32" else 2
    per_token = mcfg.kv_bytes_per_token(dtype_bytes=b)
    block_all = per_token * engine.block_size
    seqs = scheduler.max_num_seqs
    if engine.kv_budget_bytes or engine.device != "cuda":
        budget = engine.kv_budget_bytes or CPU_KV_BUDGET
        key = "serve.engine.kv_budget_bytes" + ("" if engine.kv_budget_bytes else " (0: CPU default)")
        blocks = budget // block_all
        if blocks < 1:
            raise ConfigError(f"{key}={budget} is smaller than one KV block",
                              hint=f"one block needs {block_all} bytes")
        return MemoryPlan(int(blocks), seqs, budget, f"{key}={budget}")
    import torch

    layers = [len(x) for x in split_layers(mcfg.num_hidden_layers, stages)]
    fixed, per_seq = activation_reserve(mcfg, engine, scheduler, gather=backend == "sdpa_gather")
    plans = []
    for s, n in enumerate(layers):
        free, _total = torch.cuda.mem_get_info(s)
        w = stage_weight_bytes(mcfg, n, s == 0, s == stages - 1, b, engine.quantize != "none")
        blk = mcfg.kv_bytes_per_token(n_layers=n, dtype_bytes=b) * engine.block_size
        plans.append((gpu_kv_plan(free, w, engine.gpu_memory_utilization, blk, fixed, per_seq,
                                  seqs), free, w))
    (blocks, seqs), free, w = min(plans, key=lambda p: p[0])
    if blocks < 1:
        raise ConfigError(
            f"serve.engine.gpu_memory_utilization={engine.gpu_memory_utilization}: the GPU's "
            f"{free / 2**30:.1f} GiB free less {w / 2**30:.1f} GiB of weights and the step's "
            f"reserve ({fixed / 2**30:.1f} GiB) holds no KV block",
            hint="raise it, lower serve.scheduler.max_batched_tokens, or add stages")
    return MemoryPlan(blocks, seqs, blocks * block_all,
                      f"serve.engine.gpu_memory_utilization={engine.gpu_memory_utilization} of "
                      f"{free / 2**30:.1f} GiB free after {w / 2**30:.1f} GiB of weights")
