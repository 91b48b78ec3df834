"""Transfer learning: fine-tune a pretrained surrogate on a small set at a higher level of
theory (e.g. xTB-pretrained -> DFT), with freeze options and an LR schedule.

Different levels of theory disagree by large per-element offsets (eV per atom) and a
smooth remainder; :func:`prepare_finetune` refits the element reference energies on the
new labels (keeping the learnt network) before training, then freezes what was asked:

* ``none``: everything trains (with ``backbone_lr_mult`` scaling the backbone LR);
* ``embedding``: element embeddings frozen;
* ``backbone``: embeddings + attention layers frozen, only the energy head trains;
* ``layers:K``: embeddings and the first K attention layers frozen.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from convergent.configbase import Section
from convergent.models.molecular import MolecularTransformer, fit_reference_energies


class FinetuneConfig(Section):
    """Fine-tuning options (LR in the optimiser's units; steps are optimiser steps)."""

    freeze: str = "embedding"  # none | embedding | backbone | layers:K
    lr: float = 5e-4
    backbone_lr_mult: float = 0.3  # LR multiplier of non-frozen backbone parameters
    schedule: str = "cosine"  # cosine | linear | constant
    warmup_steps: int = 20
    refit_reference: bool = True


def freeze(model: MolecularTransformer, mode: str) -> list[str]:
    """Freeze parameters by ``mode`` (see module docstring); returns frozen names."""
    if mode == "none":
        prefixes: tuple[str, ...] = ()
    elif mode == "embedding":
        prefixes = ("embedding.",)
    elif mode == "backbone":
        prefixes = ("embedding.", "layers.")
    elif mode.startswith("layers:"):
        k = int(mode.split(":", 1)[1])
        prefixes = ("embedding.",) + tuple(f"layers.{i}." for i in range(k))
    else:
        raise ValueError(f"unknown freeze mode {mode!r} (none|embedding|backbone|layers:K)")
    frozen = []
    for name, p in model.named_parameters():
        if name.startswith(prefixes):
            p.requires_grad_(False)
            frozen.append(name)
        else:
            p.requires_grad_(True)
    return frozen


def param_groups(model: MolecularTransformer, lr: float, backbone_lr_mult: float) -> list[dict[str, Any]]:
    """Optimiser groups: energy head at ``lr``, trainable backbone at ``lr * mult``."""
    head, body = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (head if name.startswith("energy_head.") else body).append(p)
    groups = [{"params": head, "lr": lr, "name": "head"}]
    if body:
        groups.append({"params": body, "lr": lr * backbone_lr_mult, "name": "backbone"})
    return groups


def lr_factor(step: int, total: int, warmup: int, kind: str = "cosine") -> float:
    """LR multiplier at ``step`` (0-based): linear warm-up then cosine/linear decay to 0."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if kind == "constant" or total <= warmup:
        return 1.0
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * t))
    if kind == "linear":
        return 1.0 - t
    raise ValueError(f"unknown schedule {kind!r} (cosine|linear|constant)")


def prepare_finetune(
    model: MolecularTransformer,
    records: Iterable[Mapping[str, Any]],
    cfg: FinetuneConfig,
    total_steps: int,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """Refit element references on the new labels, freeze, and build AdamW + schedule.

    The per-atom ``scale`` of the pretrained model is kept (the network was trained in
    those units); only the element offsets move to the new level of theory.
    """
    if cfg.refit_reference:
        ref = fit_reference_energies(records)
        ref.scale = float(model.scale)
        ref.shift = float(model.shift)
        model.set_reference(ref)
    freeze(model, cfg.freeze)
    opt = torch.optim.AdamW(param_groups(model, cfg.lr, cfg.backbone_lr_mult), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, total_steps, cfg.warmup_steps, cfg.schedule)
    )
    return opt, sched

