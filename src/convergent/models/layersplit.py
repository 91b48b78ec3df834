"""How a model's layers are split over pipeline stages: one rule for training and serving.

Contiguous slices whose sizes differ by at most one, the earlier stages taking the
remainder (10 layers over 4 stages: 3, 3, 2, 2). Training's pipeline stages
(:mod:`convergent.train.taskapi`) and serving's (:mod:`convergent.serve.stage`) both
call these, so a checkpoint's layers land on the same stage in either.
"""

from __future__ import annotations

from convergent.core.errors import ConfigError

__all__ = ["split_layers", "stage_layers"]


def stage_layers(n_layers: int, stage: int, n_stages: int, what: str = "layers") -> range:
    """The layers of stage ``stage`` (0-based) of ``n_stages``; a ConfigError when a stage
    would get none (``what`` names the layer count's setting in the message)."""
    if n_stages < 1 or n_stages > n_layers:
        raise ConfigError(
            f"pipeline needs at least one layer per stage: {n_stages} stages, {what}={n_layers}"
        )
    if not 0 <= stage < n_stages:
        raise ValueError(f"stage {stage} is not one of {n_stages} stages")
    base, extra = divmod(n_layers, n_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def split_layers(n_layers: int, n_stages: int, what: str = "layers") -> list[range]:
    """Every stage's layers, in stage order (see :func:`stage_layers`)."""
    return [stage_layers(n_layers, s, n_stages, what) for s in range(n_stages)]
