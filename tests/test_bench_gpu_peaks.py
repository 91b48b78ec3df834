"""bench/gpu/peaks.py on the CPU: measured peaks, a step's FLOPs and bytes model, fractions."""

from __future__ import annotations

from bench.gpu.peaks import (
    PARAM_TRAFFIC,
    DevicePeaks,
    StepCost,
    fraction_keys,
    fractions,
    measure_peaks,
    part_fractions,
    step_cost,
    with_fractions,
)
from bench.gpu.throughput import _med

LM = ["model.kind=llama", "model.hidden=32", "model.layers=2", "model.heads=4",
      "model.mlp_ratio=4", "train.seq_len=16", "train.vocab_size=128"]


def _lm(batch: int) -> list[str]:
    return [*LM, f"train.global_batch_seqs={batch}", f"train.batch_seqs={batch}"]


def test_measured_peaks_are_positive_and_named():
    pk = measure_peaks("cpu", gemm_n=64, copy_bytes=2**20)
    assert set(pk.matmul_flops) == {"bf16", "fp32"} and pk.device == "cpu"
    assert all(v > 0 for v in pk.matmul_flops.values()) and pk.copy_bytes_per_s > 0
    assert pk.record()["gemm_n"] == 64


def test_step_cost_counts_the_batch_and_the_parameters():
    one, two = step_cost(_lm(1), "cpu", bf16=False), step_cost(_lm(2), "cpu", bf16=False)
    assert (one.units, two.units) == (16, 32)
    # matmul FLOPs are linear in the batch at a fixed sequence length; parameters are not
    assert two.flops == 2 * one.flops and two.param_bytes == one.param_bytes
    # a llama of hidden 32, 2 layers, vocab 128: embeddings 2 x 128 x 32, per layer 4 x 32^2
    # attention + 3 x 32 x 128 MLP + 2 norms, one final norm; fp32
    n = 2 * 128 * 32 + 2 * (4 * 32 * 32 + 3 * 32 * 128 + 2 * 32) + 32
    assert one.param_bytes == 4 * n
    assert two.saved_bytes > one.saved_bytes > 0
    assert one.bytes_model == 2 * one.saved_bytes + PARAM_TRAFFIC * one.param_bytes


def test_fractions_of_the_peaks():
    pk = DevicePeaks("cpu", {"bf16": 1e12, "fp32": 1e11}, 1e11, 64, 2**20)
    cost = StepCost(units=1000, flops=10**9, saved_bytes=10**6, param_bytes=10**5)
    f = fractions(2000.0, cost, pk, "bf16")  # 2 steps/s
    assert f["achieved_flops"] == 2e9 and f["matmul_fraction"] == 2e-3
    assert f["bandwidth_fraction"] == 2 * (2e6 + PARAM_TRAFFIC * 1e5) / 1e11
    assert fractions(None, cost, pk, "bf16")["matmul_fraction"] is None
    part = {"summary": {"ours_bf16": {"per_s": {"median": 2000.0}},
                        "ours_fp32": {"per_s": {"median": 1000.0}}}}
    sides = part_fractions(part, {True: cost, False: cost}, pk, _med)
    assert set(sides) == {"ours_bf16", "ours_fp32"}
    assert sides["ours_fp32"]["matmul_peak_dtype"] == "fp32"  # no tf32 on CPU
    assert sides["ours_fp32"]["matmul_fraction"] == 1e-2


def test_with_fractions_and_the_top_level_keys():
    part = {"summary": {"ours_bf16": {"per_s": {"median": 3200.0}},
                        "ours_fp32": {"per_s": {"median": 1600.0}}}}
    out = with_fractions(part, _lm(2), "cpu", _med)
    assert "fractions_of_peak_error" not in out
    assert set(out["step_cost"]) == {"bf16", "fp32"} and out["step_cost"]["fp32"]["units"] == 32
    side = out["fractions_of_peak"]["ours_bf16"]  # 3200 tokens/s = 100 steps/s of 32 tokens
    assert side["achieved_flops"] == 100 * out["step_cost"]["bf16"]["flops"]
    keys = fraction_keys({"lm": out})
    assert keys["lm_matmul_fraction_bf16"] == side["matmul_fraction"] > 0
    assert keys["molecular_matmul_fraction_bf16"] is None
    assert keys["device_peaks"]["device"] == "cpu"
    broken = with_fractions({"summary": {}}, ["model.kind=nonsense"], "cpu", _med)
    assert "fractions_of_peak_error" in broken and "fractions_of_peak" not in broken
