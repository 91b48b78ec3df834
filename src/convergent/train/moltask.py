"""The molecular surrogate task: energies (eV) and forces (eV/Å) of molecules.

The data access, batch plan and loss live in :mod:`convergent.train.moldata`, the
pipeline stages in :mod:`convergent.train.molpipe`; this class wires them to the
:class:`~convergent.train.taskapi.Task` interface.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from convergent.core.errors import ConfigError
from convergent.models.losses import BASELINE_KEYS, SUM_KEYS, baseline_sums, metrics_from_sums
from convergent.train import moldata, molpipe
from convergent.train.taskapi import MicroBatch, Task, split_evenly

if TYPE_CHECKING:
    from convergent.config import ConvergentConfig


class MolecularTask(Task):
    """Energies (eV) and forces (eV/Å) of molecules with :mod:`convergent.models`: the
    network of ``model.kind`` (``molecular``, ``mace``, ``schnet`` or ``painn``, built by
    :func:`moldata.build`).

    Loss of a global batch: :mod:`convergent.models.losses`, computed from sums so that
    ranks' shares add up to the global-batch loss.
    """

    kind = "molecular"
    unit = "atoms"
    stat_keys = SUM_KEYS + BASELINE_KEYS  # validation's sums

    @property
    def pipeline_capable(self) -> bool:  # type: ignore[override]
        """Pipeline stages need direct forces (no double backward across stages): the
        molecular model's force head (MACE has none)."""
        return self.cfg.model.kind == "molecular" and self.cfg.model.forces == "direct"

    @property
    def double_backward(self) -> bool:
        """Autograd forces = -dE/dpositions are trained through the parameters."""
        return self.cfg.model.forces == "autograd"

    def __init__(self, cfg: ConvergentConfig) -> None:
        super().__init__(cfg)
        t = cfg.train
        if not t.dataset:
            raise ConfigError(
                "train.dataset is not set", hint="point it at a dataset directory"
            )
        self.data = moldata.MoleculeSource(
            t.dataset, cfg.data, t.extra_datasets, t.record_order, t.seed if t.bootstrap else None
        )
        self.val = moldata.MoleculeSource(t.val_dataset, cfg.data) if t.val_dataset else None
        # the plans of the 2 epochs last used, and every planned epoch's batch count: a
        # step finds its epoch from the counts without re-planning the earlier epochs
        self._epoch_cache: dict[tuple[int, int, int], list[list[int]]] = {}
        self._epoch_lens: dict[tuple[int, int, int], int] = {}
        self._feed: Any = None  # molpipe.Feed of the pipeline strategy

    # delegated to moldata to keep this file readable
    def build_model(self) -> nn.Module:
        model = moldata.build(self.cfg, self.data)
        return model

    def global_budget(self, dp_world: int, accum: int) -> int:
        t = self.cfg.train
        return int(t.global_batch_atoms or t.batch_atoms * dp_world * accum)

    def epoch_plan(self, epoch: int, budget: int, parts: int) -> list[list[int]]:
        key = (epoch, budget, parts)
        plan = self._epoch_cache.get(key)
        if plan is None:
            plan = moldata.plan_epoch(
                self.data.atom_counts, budget, parts, self.cfg.train.seed + 7919 * epoch
            )
            while len(self._epoch_cache) >= 2:
                self._epoch_cache.pop(next(iter(self._epoch_cache)))
            self._epoch_cache[key] = plan
            self._epoch_lens[key] = len(plan)
        return plan

    def global_batch(self, step: int, budget: int, parts: int) -> list[int]:
        epoch, pos = 0, step
        while True:
            n = self._epoch_lens.get((epoch, budget, parts))
            if n is None:
                n = len(self.epoch_plan(epoch, budget, parts))
            if not n:
                raise ConfigError(
                    f"train.dataset has too few molecules for {parts} micro-batches per step"
                )
            if pos < n:
                return self.epoch_plan(epoch, budget, parts)[pos]
            pos -= n
            epoch += 1

    def micro_batches(self, step: int, dp_rank: int, dp_world: int, accum: int) -> list[MicroBatch]:
        parts = dp_world * accum
        idx = self.global_batch(step, self.global_budget(dp_world, accum), parts)
        counts = [self.data.atom_counts[i] for i in idx]
        bins = split_evenly(counts, parts)
        norm = {"molecules": float(len(idx)), "atoms": float(sum(counts))}
        out = []
        for a in range(accum):
            mine = [idx[j] for j in bins[a * dp_world + dp_rank]]
            out.append(moldata.micro_batch(self.data, mine, norm))
        return out

    def to(self, mb: MicroBatch, device: torch.device) -> MicroBatch:
        return MicroBatch(mb.data.to(device), mb.samples, mb.units, mb.norm)

    def loss(self, model: nn.Module, mb: MicroBatch, dp_world: int) -> tuple[torch.Tensor, dict]:
        return moldata.loss(model, mb, dp_world, self.cfg.train.force_weight, True)

    def finalize_stats(self, sums: dict[str, float]) -> dict[str, float]:
        return metrics_from_sums(sums, self.cfg.train.force_weight)

    def val_batches(self, dp_rank: int, dp_world: int) -> list[MicroBatch]:
        if self.val is None:
            return []
        budget = self.cfg.train.batch_atoms
        plan = moldata.plan_epoch(self.val.atom_counts, budget, 1, None)
        plan = plan[: self.cfg.train.val_max_batches]
        return [
            moldata.micro_batch(self.val, b, {"molecules": 1.0, "atoms": 1.0})
            for i, b in enumerate(plan)
            if i % dp_world == dp_rank
        ]

    def val_stats(self, model: nn.Module, mb: MicroBatch) -> dict[str, torch.Tensor]:
        _, stats = moldata.loss(model, mb, 1, self.cfg.train.force_weight, False)
        return {**stats, **baseline_sums(model, mb.data)}

    def export(self, model: nn.Module, directory: Any) -> None:
        moldata.export(model, self.cfg, directory)

    # pipeline support (model.forces=direct): see convergent.train.molpipe
    def feed(self) -> Any:
        """This rank's padded pipeline micro-batches (created with the first stage)."""
        if self._feed is None:
            counts = list(self.data.atom_counts) + (self.val.atom_counts if self.val else [])
            budget = molpipe.Budget.plan(
                self.global_budget(1, 1), max(counts), self.cfg.parallel.microbatches,
                self.cfg.model.max_neighbors,
            )
            self._feed = molpipe.Feed(budget)
        return self._feed

    def stage_module(self, full: nn.Module, stage: int, n_stages: int) -> nn.Module:
        return molpipe.stage_module(full, stage, n_stages, self.feed())

    def stage_io(self, stage: int, n_stages: int, device: torch.device) -> Any:
        return molpipe.stage_io(
            self.feed().budget, self.cfg.model.state_width, stage == 0, stage == n_stages - 1, device
        )

    def pipeline_rounds(
        self, mb: MicroBatch, state: dict[str, Any], training: bool
    ) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
        feed, n = self.feed(), self.cfg.parallel.microbatches
        state.clear()
        state.update(norm=mb.norm, stats={})  # micro-batch index -> its sum statistics
        feed.load(mb.data, molpipe.micro_groups(mb.data, n, feed.budget, training))
        dev = mb.data.numbers.device
        return [
            ((torch.arange(k, k + n, device=dev),), torch.arange(k, k + n, device=dev))
            for k in range(0, len(feed.items), n)
        ]

    def pipeline_loss(self, output: Any, target: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        loss, stats = molpipe.padded_loss(
            output, self.feed()[target], state["norm"], self.cfg.train.force_weight
        )
        state["stats"][int(target.reshape(-1)[0])] = stats
        return loss

    def pipeline_sums(
        self, state: dict[str, Any], mb: MicroBatch, last: bool, losses: list[torch.Tensor]
    ) -> dict[str, float]:
        done = float(last)
        sums = {k: sum(s.get(k, 0.0) for s in state["stats"].values()) * done for k in SUM_KEYS}
        return {**sums, "samples": mb.samples * done, "units": mb.units * done}
