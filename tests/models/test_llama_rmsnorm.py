"""RMSNorm's one-call CPU float32 path (``F.rms_norm``) equals the composed reference
formula bit for bit (the serving forward relies on it for its token-exact tests)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from convergent.models.llama import LlamaConfig  # noqa: E402
from convergent.models.llama_model import RMSNorm  # noqa: E402


def _composed(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * h.to(x.dtype)


@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 512), (300, 96), (33, 2048)])
def test_cpu_float32_path_equals_the_composed_formula(rows, hidden):
    g = torch.Generator().manual_seed(rows * hidden)
    norm = RMSNorm(hidden, LlamaConfig.tiny().rms_norm_eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=g))
    x = torch.randn(rows, hidden, generator=g) * 3
    with torch.no_grad():
        assert torch.equal(norm(x), _composed(norm, x))
        xb = x.bfloat16()  # other dtypes keep the composed formula itself
        assert torch.equal(norm.bfloat16()(xb), _composed(norm.bfloat16(), xb))
