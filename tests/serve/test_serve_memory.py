"""KV blocks and sequences per step from the GPU's free memory (serve.engine.
gpu_memory_utilization, as vLLM's), as a rule on given numbers; the CPU's budget as before."""

from __future__ import annotations

import pytest

from convergent.core.errors import ConfigError
from convergent.models.llama_config import LlamaConfig
from convergent.serve.config import EngineConfig, SchedulerConfig, ServeConfig
from convergent.serve.memory import (
    CONTEXT_RESERVE,
    CPU_KV_BUDGET,
    activation_reserve,
    gpu_kv_plan,
    plan_memory,
    stage_weight_bytes,
    step_capacity,
)

GiB = 2**30
# the 1.1B random Llama of bench/gpu/throughput.py
LLAMA_1B = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                       num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                       max_position_embeddings=4096)


def test_rule_on_given_numbers():
    # 80 GiB free, 2 GiB of weights, 0.9: 70.2 GiB; 1 GiB fixed + 1 MiB a sequence
    blocks, seqs = gpu_kv_plan(80 * GiB, 2 * GiB, 0.9, 2**20, GiB, 2**20, 256)
    budget = int(78 * GiB * 0.9) - GiB
    assert seqs == 256 and blocks == (budget - 256 * 2**20) // 2**20
    # utilization scales the memory after the weights
    assert gpu_kv_plan(80 * GiB, 2 * GiB, 0.5, 2**20, 0, 0, 256)[0] == 39 * 1024
    # a small card: fewer sequences, as many as hold their reserve and a block each
    blocks, seqs = gpu_kv_plan(3 * GiB, 2 * GiB, 1.0, 2**20, 0, 7 * 2**20, 256)
    assert seqs == 1024 // 8 and blocks == 1024 - seqs * 7 and blocks >= seqs
    # nothing left after the weights (or the fixed reserve): no blocks, no sequences
    assert gpu_kv_plan(2 * GiB, 3 * GiB, 0.9, 2**20, 0, 0, 256) == (0, 0)
    assert gpu_kv_plan(4 * GiB, 2 * GiB, 0.5, 2**20, GiB, 0, 256) == (0, 0)


def test_one_billion_parameters_fill_an_h100_with_256_sequences():
    eng = EngineConfig(device="cuda", dtype="bfloat16")
    sched = SchedulerConfig()
    w = stage_weight_bytes(LLAMA_1B, 22, True, True, 2)
    assert 2.0e9 < w < 2.3e9  # 1.1B parameters in bf16 (untied head)
    assert w == LLAMA_1B.n_params * 2
    fixed, per_seq = activation_reserve(LLAMA_1B, eng, sched, gather=False)
    assert CONTEXT_RESERVE < fixed < CONTEXT_RESERVE + GiB and per_seq == 3 * 32000 * 4
    block = LLAMA_1B.kv_bytes_per_token(dtype_bytes=2) * 16
    blocks, seqs = gpu_kv_plan(79 * GiB, w, 0.9, block, fixed, per_seq, sched.max_num_seqs)
    assert seqs == 256
    assert blocks * block > 60 * GiB  # the KV cache takes the card
    # the gather path reserves each sequence's padded K/V copy of max_model_len tokens
    _, per_seq_g = activation_reserve(LLAMA_1B, eng, sched, gather=True)
    assert per_seq_g - per_seq == 2 * eng.max_model_len * 4 * 64 * 2


def test_weights_split_over_stages_and_int8():
    total = sum(stage_weight_bytes(LLAMA_1B, n, s == 0, s == 1, 2) for s, n in enumerate([11, 11]))
    assert total == stage_weight_bytes(LLAMA_1B, 22, True, True, 2)
    assert stage_weight_bytes(LLAMA_1B, 22, True, True, 2, quantized=True) < 0.6 * total
    tied = LlamaConfig.tiny(tie_word_embeddings=True)
    untied = LlamaConfig.tiny()
    assert (stage_weight_bytes(untied, 4, True, True, 4) - stage_weight_bytes(tied, 4, True, True, 4)
            == 320 * 64 * 4)


def test_cpu_and_explicit_budgets_are_as_before():
    mcfg = LlamaConfig.tiny()
    sched = SchedulerConfig(max_num_seqs=32)
    per_block = mcfg.kv_bytes_per_token(dtype_bytes=4) * 16
    p = plan_memory(EngineConfig(), sched, mcfg, 2, "sdpa_gather")
    assert EngineConfig().kv_budget_bytes == 0  # auto
    assert (p.num_blocks, p.max_num_seqs, p.kv_budget_bytes) == (CPU_KV_BUDGET // per_block, 32,
                                                                 CPU_KV_BUDGET)
    p = plan_memory(EngineConfig(kv_budget_bytes=10 * per_block + 5, device="cuda"), sched, mcfg, 1,
                    "triton")  # an explicit budget: exactly it, on CUDA too (no GPU asked)
    assert p.num_blocks == 10 and "serve.engine.kv_budget_bytes" in p.source
    with pytest.raises(ConfigError, match=r"serve\.engine\.kv_budget_bytes=100 is smaller"):
        plan_memory(EngineConfig(kv_budget_bytes=100), sched, mcfg, 1, "sdpa_gather")


def test_config_bounds():
    assert EngineConfig().gpu_memory_utilization == 0.9
    assert EngineConfig(gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0
    for bad in (0, -0.1, 1.01, float("nan")):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="paged")
    assert ServeConfig().engine.attention_backend == "auto"


def test_step_capacity_holds_a_full_step():
    eng, sched = EngineConfig(), SchedulerConfig()
    cap = step_capacity(eng, sched)
    width = eng.max_model_len // eng.block_size
    # positions, slots and ids of the token budget, and every sequence's block-table row
    assert cap >= 3 * sched.max_batched_tokens + sched.max_num_seqs * width
    assert cap * 8 < 2**20  # under a MiB of pinned memory per buffer
