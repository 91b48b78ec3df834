"""Process set-up of a training rank: its device, the LR schedule, fault injection."""

from __future__ import annotations

import fnmatch
import logging
import math
import os
import signal
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Callable

    from convergent.config import ConvergentConfig
    from convergent.train.budget import TimeBudget


log = logging.getLogger("convergent.train")

FAULT_ENV = "CONVERGENT_TRAIN_FAULT"  # "rank=R,step=S": SIGKILL rank R at step S, attempt 0


def pick_device(pref: str, local_rank: int, tf32: bool = True) -> torch.device:
    """``cuda:LOCAL_RANK`` (within CUDA_VISIBLE_DEVICES) or the CPU; TF32 on CUDA."""
    if pref == "cuda" or (pref == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        # TF32 tensor cores for fp32 matmuls (and cuDNN convolutions) unless disabled
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = tf32
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def lr_lambda(cfg: ConvergentConfig, budget: TimeBudget | None = None) -> Callable[[int], float]:
    """The LR factor after ``step`` optimizer steps: linear warm-up over ``warmup_steps``,
    then cosine to ``min_lr_ratio`` over the remaining steps — or, with a time budget,
    over the budget's fraction spent (``budget.fraction``, agreed across ranks)."""
    t = cfg.train

    def f(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.lr_schedule == "constant":
            return 1.0
        if budget is not None and budget.seconds is not None:
            prog = min(1.0, budget.fraction)
        else:
            prog = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog))

    return f


def maybe_fault(rank: int, step: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    kv = dict(item.split("=", 1) for item in spec.split(","))
    if int(kv.get("rank", -1)) == rank and int(kv.get("step", -1)) == step:
        log.warning("fault injection: SIGKILL rank %d at step %d", rank, step)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


def param_groups(model: Any, lr: float, patterns: dict[str, float]) -> list[dict[str, Any]]:
    """Optimizer groups of ``model``'s trainable parameters: those whose name matches a
    pattern of ``patterns`` (fnmatch; the first match wins) at ``lr`` times its multiplier,
    the rest at ``lr`` (``train.param_lr``). One group, in parameter order, without
    patterns."""
    groups: dict[float, list[Any]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            mult = next((m for pat, m in patterns.items() if fnmatch.fnmatch(name, pat)), 1.0)
            groups.setdefault(mult, []).append(p)
    return [{"params": ps, "lr": lr * m} for m, ps in groups.items()]
