"""bench/gpu/attention.py's decode-attention micro-benchmark, smoke-run on the CPU at tiny
shapes (one rep; no timing is asserted): every side runs or says why not, and the sides'
outputs agree with the gather side's."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from bench.gpu.attention import decode_attention_bench  # noqa: E402


def test_decode_attention_bench_smoke_on_cpu():
    res = decode_attention_bench("cpu", shapes=[(3, 20), (5, 9)], dtypes=("float32", "bfloat16"),
                                 reps=1, budget_s=300.0, model=dict(nq=4, nkv=2, hd=16, block_size=4))
    assert res["device"] == "cpu" and len(res["rows"]) == 4
    for row in res["rows"]:
        assert row["kv_bytes"] == row["context_tokens"] * 2 * 16 * 2 * (4 if row["dtype"] == "float32" else 2)
        assert row["build_host_us"] > 0
        sides = row["sides"]
        # the triton side needs CUDA or TRITON_INTERPRET=1 (not set in the suite's workers)
        assert set(sides) >= {"sdpa_gather", "flex"}
        for name in ("sdpa_gather", "flex"):
            s = sides[name]
            assert s["median_us"] > 0 and s["first_call_s"] >= 0, (name, s)
            tol = 1e-5 if row["dtype"] == "float32" else 0.1
            assert s["max_abs_diff_vs_gather"] <= tol, (name, s)
        assert sides["sdpa_gather"]["speedup_vs_gather"] == 1.0


def test_sides_past_the_budget_are_skipped_not_run():
    res = decode_attention_bench("cpu", shapes=[(2, 8)], reps=1, budget_s=0.0,
                                 model=dict(nq=2, nkv=1, hd=8, block_size=4))
    assert all("skipped" in s for s in res["rows"][0]["sides"].values())
