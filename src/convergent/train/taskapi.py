"""The task interface: what a training task gives the trainer and the strategies.

A :class:`Task` builds the plain model, plans the data and computes the loss; the
strategies in :mod:`convergent.train.parallel` never look inside it. The tasks are
:class:`~convergent.train.lmtask.LMTask` and
:class:`~convergent.train.moltask.MolecularTask`; :func:`convergent.train.tasks.make_task`
picks one from the config.

**Global batch plan.** Both tasks plan one *global* batch per optimizer step from the
seed alone (independent of the number of ranks), then split it into ``parts =
dp_world * grad_accum`` micro-batches; data-parallel rank ``r`` takes parts ``r,
r + dp_world, ...`` (one per micro-step). The loss of a micro-batch is its *sum* over
molecules/atoms/tokens divided by the *global* counts, times ``dp_world`` (DDP and FSDP
average gradients over ranks), so the summed gradient of one step is exactly the
gradient of the global-batch loss: any world size reproduces the single-process run up
to floating-point summation order. The loader state is just ``(epoch, position)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from convergent.models import layersplit

if TYPE_CHECKING:
    from convergent.config import ConvergentConfig


@dataclass
class MicroBatch:
    """One rank's share of a global batch for one micro-step."""

    data: Any  # task-specific (AtomsBatch, or (input_ids, targets))
    samples: int  # molecules or sequences
    units: int  # atoms or tokens
    norm: dict[str, float] = field(default_factory=dict)  # global denominators


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of a model (for FSDP units, activation checkpointing, compile).

    Looks for the first ``ModuleList``/``ModuleDict`` named ``layers``, ``blocks`` or
    ``interactions`` (breadth-first); returns ``[(qualified_name, block), ...]``.
    """
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("layers", "blocks", "interactions") and isinstance(
            mod, nn.ModuleList | nn.ModuleDict
        ):
            items = mod.items() if isinstance(mod, nn.ModuleDict) else enumerate(mod)
            return [(f"{name}.{k}", m) for k, m in items]
    return []


def split_evenly(sizes: list[int], parts: int) -> list[list[int]]:
    """Assign items (by size) to ``parts`` bins greedily, largest first, keeping order.

    Deterministic; every bin gets at least one item when ``len(sizes) >= parts``.
    """
    if parts == 1:  # the greedy assignment below puts everything in the one bin
        return [list(range(len(sizes)))]
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    bins: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in order:
        # empty bins first so each gets an item, then the lightest
        b = min(range(parts), key=lambda j: (len(bins[j]) > 0, load[j], j))
        bins[b].append(i)
        load[b] += sizes[i]
    return [sorted(b) for b in bins]


def stage_layers(n_layers: int, stage: int, n_stages: int) -> range:
    """The layers of pipeline stage ``stage`` of ``n_stages``: the rule serving uses too
    (:func:`convergent.models.layersplit.stage_layers`), at least one each (else a
    ConfigError naming ``model.layers``)."""
    return layersplit.stage_layers(n_layers, stage, n_stages, what="model.layers")


class Task:
    """Interface of a training task (see the module doc for the batch plan)."""

    kind = "task"
    unit = "units"  # "atoms" or "tokens"
    stat_keys: tuple[str, ...] = ()  # the sum statistics of :meth:`val_stats`
    pipeline_capable = False

    def __init__(self, cfg: ConvergentConfig) -> None:
        self.cfg = cfg

    def build_model(self) -> nn.Module:  # pragma: no cover - interface
        raise NotImplementedError

    def micro_batches(self, step: int, dp_rank: int, dp_world: int, accum: int) -> list[MicroBatch]:
        """This rank's micro-batches of global step ``step`` (0-based)."""
        raise NotImplementedError

    def loss(self, model: nn.Module, mb: MicroBatch, dp_world: int) -> tuple[torch.Tensor, dict]:
        """(scaled loss for backward, dict of *sum* statistics as 0-d tensors)."""
        raise NotImplementedError

    def finalize_stats(self, sums: dict[str, float]) -> dict[str, float]:
        """Global sums (all ranks, all micro-steps) -> reported metrics."""
        raise NotImplementedError

    def val_batches(self, dp_rank: int, dp_world: int) -> list[MicroBatch]:
        return []

    def val_stats(self, model: nn.Module, mb: MicroBatch) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def export(self, model: nn.Module, directory: Any) -> None:
        raise NotImplementedError

    # pipeline interface (tasks with pipeline_capable = True)
    def stage_module(self, full: nn.Module, stage: int, n_stages: int) -> nn.Module:
        """Stage ``stage`` of ``n_stages`` of the plain model ``full``."""
        raise NotImplementedError

    def stage_io(self, stage: int, n_stages: int, device: torch.device) -> Any:
        """Example ``(inputs, outputs)`` tensors of a stage for static pipeline metadata,
        or None to let torch infer it on the first micro-batch."""
        return None

    def pipeline_rounds(
        self, mb: MicroBatch, state: dict[str, Any], training: bool
    ) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
        """Reset ``state`` for ``mb``; the ``(first-stage args, target)`` of each schedule
        call (``step`` when training, ``eval`` otherwise) that covers ``mb``."""
        raise NotImplementedError

    def pipeline_loss(self, output: Any, target: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        """The schedule's loss function on the last stage. torch may call it once more
        than there are micro-batches (metadata inference), so statistics it keeps in
        ``state`` must be keyed by micro-batch, never accumulated."""
        raise NotImplementedError

    def pipeline_sums(
        self, state: dict[str, Any], mb: MicroBatch, last: bool, losses: list[torch.Tensor]
    ) -> dict[str, float]:
        """Sum statistics of ``mb`` after its rounds (``losses``: the schedule's per
        micro-batch losses); the same keys on every stage (zeros off the last stage,
        which alone computes losses)."""
        raise NotImplementedError
