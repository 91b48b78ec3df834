"""The fused Triton edge kernel on CUDA equals the torch path (marked ``gpu``; skipped
with the reason where CUDA is absent). The same checks as triton_interpreted.py, compiled
for the GPU, plus the model at the benchmark's head width (64) and ``auto``'s choice.
Tolerances: multiples of the compared dtype's eps at the values' magnitude."""

from __future__ import annotations

import pytest
import torch
from ase.build import molecule

from convergent.models import edge_triton
from convergent.models.batching import atoms_to_record, collate_records
from convergent.models.edge_kernel import edge_messages
from tests.models.edgehelpers import (
    assert_close,
    assert_energies_close,
    edge_features,
    mixed_batch,
    run_model,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.numerics,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)"),
]


@pytest.fixture(autouse=True)
def _no_tf32(monkeypatch):
    """Plain fp32 matmuls: the fp32 tolerances are fp32's, not TF32's."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


@pytest.mark.parametrize("softmax", [False, True], ids=["silu", "softmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_values_and_gradients_on_cuda(softmax, dtype):
    qkv, fe, env, recv, send, heads = edge_features(dtype, sorted_recv=True, device="cuda")
    ref_in = [t.clone().requires_grad_() for t in (qkv, fe, env)]
    q, k, v = ref_in[0].chunk(3, dim=-1)
    ref = edge_messages(q, k, v, ref_in[1], ref_in[2], recv, send, heads, softmax, "torch")
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1),
                    dtype=torch.float64).cuda()
    ref_g = torch.autograd.grad((ref * w).sum(), ref_in)
    ours_in = [t.to(dtype).requires_grad_() for t in (qkv, fe, env)]
    q, k, v = ours_in[0].chunk(3, dim=-1)
    out = edge_messages(q, k, v, ours_in[1], ours_in[2], recv, send, heads, softmax, "triton")
    assert_close(ref, out, torch.float32, k=64)  # fp32 sums of 20 products / 19 edges
    ours_g = torch.autograd.grad((out * w.float()).sum(), ours_in)
    for a, b in zip(ref_g, ours_g, strict=True):
        assert_close(a, b, dtype, k=1 if dtype == torch.bfloat16 else 64)


@pytest.mark.parametrize("weights", ["silu", "softmax"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
def test_model_triton_equals_torch_on_cuda(weights, autocast, training):
    b = mixed_batch()
    ref = run_model("torch", weights, autocast, b, training, device="cuda")
    tri = run_model("triton", weights, autocast, b, training, device="cuda")
    dtype, k = (torch.bfloat16, 8.0) if autocast else (torch.float32, 64.0)
    assert_energies_close(ref, tri, dtype, k)
    for a, c in zip(ref[1:3], tri[1:3], strict=True):
        if a is not None:
            assert_close(a, c, dtype, k)


def test_auto_runs_triton_for_inference_at_the_bench_shape(monkeypatch):
    """hidden 256, 4 heads (head width 64), ~1,000 atoms: eval-mode ``auto`` launches the
    fused kernel and agrees with torch; training mode keeps the torch path."""
    calls = []
    real = edge_triton.forward
    monkeypatch.setattr(edge_triton, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    names = ["CH3CH2OH", "C6H6", "CH3COOH", "C3H8", "H2O"]
    b = collate_records([atoms_to_record(molecule(names[i % 5]), str(i)) for i in range(100)])
    ref = run_model("torch", "silu", True, b, training=False, device="cuda", hidden=256)
    auto = run_model("auto", "silu", True, b, training=False, device="cuda", hidden=256)
    assert len(calls) > 0
    assert_energies_close(ref, auto, torch.bfloat16, 8.0)
    assert_close(ref[1], auto[1], torch.bfloat16, 8.0)
    calls.clear()
    run_model("auto", "silu", True, b, training=True, device="cuda", hidden=256)
    assert calls == []  # training: a double backward would recompute with torch anyway


def test_compiled_blocks_with_the_kernel_match_eager():
    """train.compile=blocks around the Triton path (eval mode, direct forces: first order
    only): traced or broken around by dynamo, the numbers are eager's."""
    from convergent.models.config import ModelConfig
    from convergent.models.molecular import build_model

    b = mixed_batch().to("cuda")
    out = []
    for compiled in (False, True):
        torch.manual_seed(0)
        m = build_model(ModelConfig(hidden=64, layers=2, heads=4, forces="direct",
                                    edge_kernel="triton")).cuda().eval()
        if compiled:
            for blk in m.layers:
                blk.compile()
        try:
            e, f = m(b, with_forces=True)
            (e.sum() + (f * f).sum()).backward()
        finally:
            torch.compiler.reset()
        grads = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
        out.append((e.detach(), f.detach(), grads))
    for a, c in zip(*out, strict=True):
        assert_close(a, c, torch.float32, k=64)
