"""The fused Triton edge kernel on CPU tensors under Triton's interpreter.

Run by ``test_edge_kernel.py::test_triton_kernels_under_the_interpreter`` in a process
started with ``TRITON_INTERPRET=1`` (the interpreter needs it before ``triton`` is first
imported); elsewhere every test here skips. Not named ``test_*``: the suite's collection
leaves it to that test. Tolerances: multiples of the compared dtype's eps at the values'
magnitude (see each test).
"""

from __future__ import annotations

import os

import pytest
import torch

from convergent.core.errors import ConfigError
from convergent.models.edge_kernel import edge_messages
from tests.models.edgehelpers import (
    assert_close,
    assert_energies_close,
    edge_features,
    mixed_batch,
    run_model,
)

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="needs TRITON_INTERPRET=1 set before triton is imported"),
    pytest.mark.numerics,
]


def _messages(kernel, qkv, fe, env, recv, send, heads, softmax):
    q, k, v = qkv.chunk(3, dim=-1)  # views of one tensor, as in the block
    return edge_messages(q, k, v, fe, env, recv, send, heads, softmax, kernel)


@pytest.mark.parametrize("softmax", [False, True], ids=["silu", "softmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sorted_recv", [True, False], ids=["csr", "unsorted"])
def test_values_and_first_order_gradients_match_the_reference(softmax, dtype, sorted_recv):
    """Forward and the Triton backward against messages_torch in float64 on the very
    (dtype-exact) inputs the kernel reads."""
    qkv, fe, env, recv, send, heads = edge_features(dtype, sorted_recv)
    ref_in = [t.clone().requires_grad_() for t in (qkv, fe, env)]
    ref = _messages("torch", *ref_in, recv, send, heads, softmax)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref_g = torch.autograd.grad((ref * w).sum(), ref_in)
    ours_in = [t.to(dtype).requires_grad_() for t in (qkv, fe, env)]
    out = _messages("triton", *ours_in, recv, send, heads, softmax)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    # the kernel reads dtype and works in fp32: sums of 20 products and of up to 19 edges,
    # each term rounded in fp32 (64 eps covers those ~40 roundings at the values' size)
    assert_close(ref, out, torch.float32, k=64)
    assert float(out.detach()[[1, 5]].abs().max()) == 0  # no edges, no message
    ours_g = torch.autograd.grad((out * w.float()).sum(), ours_in)
    for a, b in zip(ref_g, ours_g, strict=True):
        assert b.dtype == dtype  # fp32 sums rounded once to dtype: 1 eps(bf16) covers it
        assert_close(a, b, dtype, k=1 if dtype == torch.bfloat16 else 64)


@pytest.mark.parametrize("softmax", [False, True], ids=["silu", "softmax"])
def test_second_order_counts_each_path_once(softmax):
    """Inputs that share ancestors (the envelope feeds the filters and, through the first
    layer, the second layer's queries): the differentiated backward, recomputed with torch,
    equals torch's own to the second order."""
    qkv, fe, env, recv, send, heads = edge_features(torch.float32)
    out = {}
    for kernel in ("torch", "triton"):
        p = env.float().clone().requires_grad_()
        e, f = torch.cos(p), fe.float() * p.unsqueeze(1)
        h = qkv.float()[:, : qkv.shape[1] // 3]
        for layer in range(2):
            x = torch.cat([h, h, h], 1) * (1 + layer) + f[: h.shape[0], :1]
            h = h + _messages(kernel, x, f, e, recv, send, heads, softmax)
        (g,) = torch.autograd.grad((h * h).sum(), p, create_graph=True)
        (gg,) = torch.autograd.grad((g * g).sum(), p)
        out[kernel] = (g.detach(), gg)
    for a, b in zip(out["torch"], out["triton"], strict=True):
        assert_close(a, b, torch.float32, k=64)


@pytest.mark.parametrize("weights", ["silu", "softmax"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
def test_model_with_the_triton_kernel_matches_torch(weights, autocast, training):
    """The model with edge_kernel triton against torch (a lone atom and atoms without
    edges in the batch): energies, forces (inference: the Triton backward; training: the
    recomputed, differentiable one) and the parameter gradients through the double
    backward."""
    b = mixed_batch(small=True)
    ref = run_model("torch", weights, autocast, b, training, heads=2)
    tri = run_model("triton", weights, autocast, b, training, heads=2)
    # bf16: torch rounds each edge's products to bf16 where the kernel keeps them in fp32,
    # so activations differ by ~1 eps(bf16), carried through two layers and the backward
    # (8 eps); fp32: the kernel's sums in another order (64 eps, as for the kernel alone)
    dtype, k = (torch.bfloat16, 8.0) if autocast else (torch.float32, 64.0)
    assert_energies_close(ref, tri, dtype, k)
    for a, c in zip(ref[1:3], tri[1:3], strict=True):
        if a is not None:
            assert_close(a, c, dtype, k)


def test_triton_refuses_float64():
    qkv, fe, env, recv, send, heads = edge_features(torch.float32)
    with pytest.raises(ConfigError, match="not torch.float64"):
        _messages("triton", qkv, fe, env, recv, send, heads, True)
