"""bench/gpu/edge.py's top-level keys of gpu.json, from a partial result (no CUDA needed)."""

from __future__ import annotations

from bench.gpu.edge import KERNELS, edge_keys
from bench.gpu.throughput import _med, _ratio


def _part(per_s: dict[str, float], failed: dict[str, str]) -> dict:
    return {"summary": {k: {"per_s": {"median": v}} for k, v in per_s.items()}, "failed": failed}


def test_edge_keys_ratios_and_missing_sides():
    part = _part({"index_bf16_train": 100.0, "torch_bf16_train": 110.0, "triton_bf16_train": 99.0,
                  "torch_fp32_train": 100.0, "torch_bf16_infer": 300.0,
                  "triton_bf16_infer": 450.0},
                 failed={"triton_fp32_train": "CompilationError: ..."})
    keys = edge_keys(part, _med, _ratio)
    assert keys["edge_train_atoms_per_s_bf16"] == {"index": 100.0, "torch": 110.0, "triton": 99.0}
    assert abs(keys["edge_torch_vs_index_train_bf16"] - 1.1) < 1e-12
    assert abs(keys["edge_triton_vs_torch_train_bf16"] - 0.9) < 1e-12
    assert keys["edge_triton_vs_torch_infer_bf16"] == 1.5
    assert keys["edge_bf16_vs_fp32_train"] == {"index": None, "torch": 1.1, "triton": None}
    empty = edge_keys({}, _med, _ratio)  # the part not run (or cut short): every key None
    assert all((set(v.values()) == {None} and set(v) == set(KERNELS)) if isinstance(v, dict)
               else v is None for v in empty.values())
