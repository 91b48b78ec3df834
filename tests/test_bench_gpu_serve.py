"""bench/gpu/serve.py's pure pieces on the CPU (issue 39 item 9): the trace, the step split
and TTFT/TPOT of a real tiny engine run, the bandwidth floor by hand, the 4-GPU projection
on a table calibrated from that run, the top-level keys; the GPU part refuses without CUDA."""

from __future__ import annotations

import math
import subprocess

import pytest
import torch

from bench.gpu.serve import SERVE_SHAPE, bench_serve, kv_budget_bytes, serve_keys
from bench.gpu.serve_floor import _split_table, bandwidth_floor, step_weight_bytes
from bench.gpu.throughput import _med, _ratio
from bench.lib.paths import child_env, module_argv
from convergent.models.llama import LlamaConfig
from convergent.serve.costs import BatchShape, CostTable
from convergent.serve.scheduler import Request
from convergent.serve.timing import token_latencies
from convergent.serve.tokenizer import ByteTokenizer
from convergent.serve.workload import uniform_trace

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             bos_token_id=256, eos_token_id=257)


def test_uniform_trace_is_the_item_9_trace():
    tr = uniform_trace()
    assert len(tr) == 1000
    tok = ByteTokenizer(32000)
    assert all(128 <= r.input_len <= 1024 for r in tr)
    assert all(64 <= r.output_len <= 512 for r in tr)
    assert all(len(tok.encode(r.prompt)) == r.input_len for r in tr[:50])  # BOS included
    ins = [r.input_len for r in tr]
    assert 500 < sum(ins) / len(ins) < 650  # uniform: mean ~576
    assert [r.to_dict() for r in uniform_trace()] == [r.to_dict() for r in tr]  # by seed
    assert [r.output_len for r in uniform_trace(seed=1)] != [r.output_len for r in tr]
    with pytest.raises(ValueError):
        uniform_trace(input_range=(10, 5))


def test_token_latencies_from_requests():
    reqs = []
    for i, (first, fin, n) in enumerate([(1.0, 3.0, 5), (2.0, 2.0, 1), (0.5, 4.5, 9)]):
        r = Request(i, [1, 2], n, arrival=0.0)
        r.first_token_time, r.finish_time, r.output = first, fin, [0] * n
        reqs.append(r)
    reqs.append(Request(9, [1], 4, arrival=0.0))  # never started: left out
    lat = token_latencies(reqs)
    assert lat.requests == 3
    assert lat.ttft_s_p50 == pytest.approx(1.0)
    assert lat.tpot_s_p50 == pytest.approx(0.5)  # (2/4 and 4/8); the 1-token request has none
    assert lat.tpot_s_p99 == pytest.approx(0.5)
    assert lat.ttft_s_p99 == pytest.approx(1.0 + 0.98 * (2.0 - 1.0))


def test_bandwidth_floor_by_hand():
    shapes = [BatchShape(prefill_tokens=10, prefill_pairs=55, sampled=2),
              BatchShape(decode_seqs=2, decode_ctx=30, sampled=2)]
    f = bandwidth_floor(shapes, 4, weight_bytes=1000, kv_bytes_per_token=10, bytes_per_s=1000.0)
    # step 1: 1000 + 10 x 10 new tokens; step 2: 1000 + 10 x (30 context + 2 new)
    assert f.bytes_moved == 1100 + 1320
    assert f.seconds == pytest.approx(2.42)
    assert f.tok_s == pytest.approx(4 / 2.42)
    assert (f.decode_steps, f.mean_decode_batch, f.mean_decode_context) == (1, 2.0, 15.0)


def test_floor_of_the_issues_decode_step():
    """The issue's figure: 256 sequences x ~600 tokens of context on the 1.1B model in bf16
    at 3.0 TB/s is ~2 ms a step, ~130k tok/s."""
    mcfg = LlamaConfig(**SERVE_SHAPE)
    w = step_weight_bytes(mcfg, 2)
    assert 2.0e9 < w < 2.2e9  # 22 layers + LM head, no embedding
    kv = mcfg.kv_bytes_per_token(dtype_bytes=2)
    assert kv == 22 * 2 * 4 * 64 * 2
    f = bandwidth_floor([BatchShape(decode_seqs=256, decode_ctx=256 * 600, sampled=256)], 256,
                        w, kv, 3.0e12)
    assert 1.6e-3 < f.seconds < 2.1e-3
    assert 120e3 < f.tok_s < 160e3
    # the KV budget the bench sets holds 256 x 1,536 tokens
    assert kv_budget_bytes(mcfg, 2, 256, 1536) >= 256 * 1536 * kv


def test_split_table_by_layers_and_link():
    one = CostTable(layers_per_stage=[4], stage_coef=[[4e-3, 8e-6, 1e-9, 2e-8, 3e-6]])
    t = _split_table(one, [2, 1, 1], act_s_per_token=1e-7, hop=2e-5)
    assert t.layers_per_stage == [2, 1, 1] and t.hop == 2e-5
    assert t.stage_coef[0] == pytest.approx([2e-3, 4e-6, 5e-10, 1e-8, 0.0])
    assert t.stage_coef[2] == pytest.approx([1e-3, 2e-6 + 1e-7, 2.5e-10, 5e-9, 3e-6])
    s = BatchShape(decode_seqs=8, decode_ctx=800, sampled=8)
    no_link = sum(t.stage_time(s, i) for i in range(3)) - 2 * 8 * 1e-7
    assert no_link == pytest.approx(one.stage_time(s, 0))


@pytest.fixture(scope="module")
def cpu_part(tmp_path_factory):
    tr = uniform_trace(20, seed=3, input_range=(8, 40), output_range=(3, 16))
    return bench_serve(tmp_path_factory.mktemp("serve"), 1, hf_requests=6, hf_batch=3,
                       device="cpu", shape=SMALL, trace=tr)


def test_cpu_run_step_split_and_latencies(cpu_part):
    assert cpu_part["failed"] == {}
    row = cpu_part["per_round"]["ours_bf16"][0]
    split = row["step_split"]
    assert split["gpu_timer"] == "stage_busy" and split["steps"] == row["steps"] > 0
    # on the CPU the stages compute inside submit: host prepare + compute + sync = the loop
    assert split["host_prepare_s"] + split["gpu_s"] + split["sync_s"] == pytest.approx(
        split["wall_s"])
    assert 0 <= split["decide_s"] <= split["host_prepare_s"]
    # every step is a pure decode or a mixed one (the first steps prefill: mixed)
    kinds = split["by_kind"]
    assert set(kinds) == {"decode", "mixed"}
    assert kinds["decode"]["steps"] + kinds["mixed"]["steps"] == split["steps"]
    assert kinds["mixed"]["steps"] >= 1 and all(k["gpu_ms_per_step"] is None
                                                for k in kinds.values())
    assert math.isclose(split["gpu_fraction"], split["gpu_s"] / split["wall_s"])
    assert 0 < row["ttft_s_p50"] <= row["ttft_s_p99"] <= row["wall_s"]
    assert 0 < row["tpot_s_p50"] <= row["tpot_s_p99"]
    assert row["output_tokens"] == cpu_part["settings"]["ours_bf16"]["output_tokens"]


def test_cpu_part_floor_projection_and_keys(cpu_part):
    keys = serve_keys(cpu_part, _med, _ratio)
    assert keys["serve_output_tok_s_bf16"] == cpu_part["summary"]["ours_bf16"]["per_s"]["median"]
    assert keys["serve_bf16_speedup_vs_fp32"] == pytest.approx(
        keys["serve_output_tok_s_bf16"] / keys["serve_output_tok_s_fp32"])
    hf = cpu_part["summary"]["hf_generate_bf16_batch3"]["per_s"]["median"]
    assert keys["serve_vs_hf_generate"] == pytest.approx(keys["serve_output_tok_s_bf16"] / hf)
    assert keys["serve_vs_hf_generate_same_requests"] > 0
    assert keys["serve_step_split"]["steps"] > 0
    floor = cpu_part["floor"]
    assert floor["steps"] == keys["serve_step_split"]["steps"]
    assert keys["serve_fraction_of_floor"] == pytest.approx(
        keys["serve_output_tok_s_bf16"] / keys["serve_bandwidth_floor_tok_s"])
    proj = keys["serve_projection_4gpu_pcie"]
    assert "error" not in proj, proj
    assert proj["tdpipe_tok_s"] > 0 and proj["interleaved_tok_s"] > 0
    assert proj["ratio"] == pytest.approx(proj["tdpipe_tok_s"] / proj["interleaved_tok_s"])
    a = proj["assumptions"]
    assert a["stages"] == 4 and a["link_bytes_per_s"] == 25e9
    assert a["activation_bytes_per_token"] == SMALL["hidden_size"] * 2
    runs = cpu_part["projection"]["runs"]
    assert runs["tdpipe"]["output_tok_s"] == proj["tdpipe_tok_s"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_gpu_serve_part_needs_cuda_and_exits_2(tmp_path):
    out = tmp_path / "gpu.json"
    p = subprocess.run([*module_argv("bench.gpu.throughput"), "--only", "serve", "--out", str(out)],
                       capture_output=True, text=True, env=child_env(CUDA_VISIBLE_DEVICES=""),
                       timeout=120)
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and "needs a CUDA GPU" in p.stderr
    assert not out.exists()
