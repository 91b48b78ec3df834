"""An exponential moving average of a model's weights, the Trainer's one EMA.

``update`` after every optimizer step blends the trainable parameters into a shadow copy
with decay ``min(decay, (1 + step) / (10 + step))`` (a short memory early on, when the
weights move most); ``install`` copies the shadow into the model at the end of training,
so the final checkpoint and the exported model are the averaged weights.
"""

from __future__ import annotations

import torch
from torch import nn


class WeightAverage:
    """EMA of the trainable parameters of ``parts`` (the Trainer's local model parts)."""

    def __init__(self, parts: list[nn.Module], decay: float) -> None:
        self.decay = decay
        self.params = [p for m in parts for p in m.parameters() if p.requires_grad]
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Blend the current weights in after optimizer step ``step`` (0-based)."""
        d = min(self.decay, (1 + step) / (10 + step))
        for s, p in zip(self.shadow, self.params, strict=True):
            s.lerp_(p.detach(), 1.0 - d)

    @torch.no_grad()
    def install(self) -> None:
        """Replace the weights by their average."""
        for s, p in zip(self.shadow, self.params, strict=True):
            p.copy_(s)
