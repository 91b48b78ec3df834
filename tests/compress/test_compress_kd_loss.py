"""The distillation loss of the language model (``convergent.compress.distill.kd_loss``):
its two limits, the T^2 gradient scaling and the refusal of mismatched logits."""

from __future__ import annotations

import pytest
import torch


def _logits(seed: int, shape=(3, 5, 11)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2


def test_alpha_zero_is_the_hard_cross_entropy():
    from convergent.compress.distill import kd_loss

    s, t = _logits(0), _logits(1)
    y = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(2))
    loss, ce = kd_loss(s, t, y, temperature=2.0, alpha=0.0)
    ref = torch.nn.functional.cross_entropy(s.reshape(-1, 11), y.reshape(-1), reduction="sum")
    assert torch.allclose(loss, ref) and torch.allclose(ce, ref)


def test_alpha_one_is_zero_at_the_teacher_and_positive_elsewhere():
    from convergent.compress.distill import kd_loss

    t = _logits(1)
    y = torch.zeros(3, 5, dtype=torch.long)
    same, _ = kd_loss(t.clone(), t, y, temperature=3.0, alpha=1.0)
    other, _ = kd_loss(_logits(0), t, y, temperature=3.0, alpha=1.0)
    assert abs(float(same)) < 1e-4 and float(other) > 0.1
    # the soft term is the KL(teacher || student) at temperature T, times T^2, summed
    s = _logits(0)
    pt = torch.softmax(t / 3.0, -1)
    kl = (pt * (torch.log(pt) - torch.log_softmax(s / 3.0, -1))).sum()
    assert torch.allclose(kd_loss(s, t, y, 3.0, 1.0)[0], 9.0 * kl, rtol=1e-5)


def test_temperature_squared_keeps_the_soft_gradient_on_one_scale():
    """At high T the soft gradient is ~ (s - t) / (V T^2) per logit; times T^2 it stays
    finite: its size changes little from T=4 to T=8 (without T^2 it would drop 4x)."""
    from convergent.compress.distill import kd_loss

    t = _logits(1) * 0.1
    y = torch.zeros(3, 5, dtype=torch.long)
    norms = []
    for temp in (4.0, 8.0):
        s = (_logits(0) * 0.1).requires_grad_(True)
        kd_loss(s, t, y, temp, 1.0)[0].backward()
        norms.append(float(s.grad.norm()))
    assert 0.8 < norms[1] / norms[0] < 1.25


def test_teacher_gets_no_gradient_and_mismatched_vocabularies_are_refused():
    from convergent.compress.distill import kd_loss
    from convergent.core.errors import InputError

    s, t = _logits(0).requires_grad_(True), _logits(1).requires_grad_(True)
    kd_loss(s, t, torch.zeros(3, 5, dtype=torch.long), 2.0, 0.5)[0].backward()
    assert t.grad is None and s.grad is not None
    with pytest.raises(InputError, match="differ"):
        kd_loss(_logits(0), _logits(1, (3, 5, 12)), torch.zeros(3, 5, dtype=torch.long), 2.0, 0.5)
