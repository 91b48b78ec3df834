"""What is trained: the molecular surrogate (energies + forces) or a Llama-style LM.

A :class:`Task` builds the plain model, plans the data and computes the loss; the
strategies in :mod:`convergent.train.parallel` never look inside it.

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

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from convergent.errors import ConfigError


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


class Task:
    """Interface of a training task (see the module doc for the batch plan)."""

    kind = "task"
    unit = "units"  # "atoms" or "tokens"
    pipeline_capable = False

    def __init__(self, cfg: Any) -> None:
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


def check_pipeline(cfg: Any) -> None:
    """Refuse ``parallel.strategy=pipeline`` for models whose training it cannot run."""
    if cfg.parallel.strategy != "pipeline" or cfg.model.kind != "molecular":
        return
    if cfg.model.forces != "direct":
        raise ConfigError(
            "parallel.strategy=pipeline needs model.forces=direct for the molecular model "
            f"(model.forces={cfg.model.forces})",
            hint="autograd forces (-dE/dpositions) need a double backward through every "
            "stage, which pipeline schedules cannot run; set model.forces=direct (not "
            "conservative) or use parallel.strategy=ddp/fsdp/hsdp",
        )


def check_before_launch(cfg: Any, data: bool = True) -> None:
    """Config errors the ranks would hit at start-up, raised before torchrun starts
    (``data=False``: skip the dataset paths, e.g. when only printing the command)."""
    check_pipeline(cfg)
    if cfg.tracking.mlflow:
        from convergent.tracking.store import import_mlflow

        import_mlflow()  # tracking asked for but MLflow missing: one line, nothing created
    if not data or cfg.model.kind != "molecular":
        return
    for key in ("dataset", "val_dataset"):
        path = getattr(cfg.train, key)
        if key == "dataset" and not path:
            raise ConfigError(
                "train.dataset is not set",
                hint="point it at a dataset directory, e.g. -s train.dataset=runs/demo/data/train",
            )
        if path and not Path(path).exists():
            raise ConfigError(f"train.{key}: {path} does not exist")
        if path:  # a readable dataset (its manifest), before any process starts
            from convergent.data.manifest import check_dataset

            check_dataset(path, f"train.{key}")


# ----------------------------------------------------------------------------- LM


class LMTask(Task):
    """Causal language modelling with the Llama decoder of :mod:`convergent.models.llama`.

    Data: a seeded synthetic stream from a sparse random Markov chain over
    ``train.vocab_size`` tokens (each token has 4 likely successors, so the loss falls
    from ln(V) towards ~ln 4). Sequence ``j`` of step ``s`` depends only on
    ``(seed, s, j)``.
    """

    kind = "lm"
    unit = "tokens"
    pipeline_capable = True

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        t = cfg.train
        self.V = int(t.vocab_size)
        self.S = int(t.seq_len)
        g = torch.Generator().manual_seed(10_007 + t.seed)
        self.succ = torch.randint(0, self.V, (self.V, 4), generator=g)

    def llama_config(self) -> Any:
        from convergent.models.llama import LlamaConfig

        m = self.cfg.model
        return LlamaConfig(
            vocab_size=self.V,
            hidden_size=m.hidden,
            intermediate_size=m.mlp_ratio * m.hidden,
            num_hidden_layers=m.layers,
            num_attention_heads=m.heads,
            num_key_value_heads=m.heads,
            max_position_embeddings=max(2 * self.S, 128),
            bos_token_id=None,
            eos_token_id=None,
        )

    def build_model(self, layers: Any = None, embed: bool = True, head: bool = True) -> nn.Module:
        from convergent.models.llama import LlamaForCausalLM

        return LlamaForCausalLM(self.llama_config(), layers=layers, embed=embed, head=head)

    def global_seqs(self, dp_world: int, accum: int) -> int:
        t = self.cfg.train
        g = t.global_batch_seqs or t.batch_seqs * dp_world * accum
        if g % (dp_world * accum):
            raise ConfigError(
                f"train.global_batch_seqs={g} is not divisible by ranks x grad_accum "
                f"= {dp_world * accum}"
            )
        return g

    def _sequences(self, stream: int, step: int, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.cfg.train.seed, stream, step)) & 0x7FFFFFFF)
        out = torch.empty(n, self.S + 1, dtype=torch.int64)
        out[:, 0] = torch.randint(0, self.V, (n,), generator=g)
        choice = torch.randint(0, 4, (n, self.S), generator=g)
        noise = torch.rand(n, self.S, generator=g) < 0.1
        rand_tok = torch.randint(0, self.V, (n, self.S), generator=g)
        for i in range(self.S):
            nxt = self.succ[out[:, i], choice[:, i]]
            out[:, i + 1] = torch.where(noise[:, i], rand_tok[:, i], nxt)
        return out

    def micro_batches(self, step: int, dp_rank: int, dp_world: int, accum: int) -> list[MicroBatch]:
        G = self.global_seqs(dp_world, accum)
        seqs = self._sequences(0, step, G)
        parts = dp_world * accum
        per = G // parts
        out = []
        for a in range(accum):
            p = a * dp_world + dp_rank
            chunk = seqs[p * per : (p + 1) * per]
            out.append(
                MicroBatch(
                    data=(chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()),
                    samples=per,
                    units=per * self.S,
                    norm={"tokens": float(G * self.S)},
                )
            )
        return out

    def to(self, mb: MicroBatch, device: torch.device) -> MicroBatch:
        x, y = mb.data
        return MicroBatch((x.to(device), y.to(device)), mb.samples, mb.units, mb.norm)

    def loss_from_logits(self, logits: torch.Tensor, y: torch.Tensor, norm: float) -> torch.Tensor:
        ce = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
        )
        return ce / norm

    def loss(self, model: nn.Module, mb: MicroBatch, dp_world: int) -> tuple[torch.Tensor, dict]:
        x, y = mb.data
        logits = model(x)
        ce = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
        )
        loss = ce / mb.norm["tokens"] * dp_world
        return loss, {"ce_sum": ce.detach(), "tokens": torch.tensor(float(mb.units))}

    def finalize_stats(self, sums: dict[str, float]) -> dict[str, float]:
        tokens = max(sums.get("tokens", 0.0), 1.0)
        loss = sums.get("ce_sum", 0.0) / tokens
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}

    def val_batches(self, dp_rank: int, dp_world: int) -> list[MicroBatch]:
        n = max(self.cfg.train.val_max_batches, 1)
        out = []
        for i in range(dp_rank, n, dp_world):
            seqs = self._sequences(1, i, self.cfg.train.batch_seqs)
            out.append(
                MicroBatch(
                    (seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()),
                    len(seqs),
                    len(seqs) * self.S,
                    {"tokens": 1.0},
                )
            )
        return out

    def val_stats(self, model: nn.Module, mb: MicroBatch) -> dict[str, torch.Tensor]:
        x, y = mb.data
        with torch.no_grad():
            logits = model(x)
            ce = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
            )
        return {"ce_sum": ce, "tokens": torch.tensor(float(mb.units))}

    def export(self, model: nn.Module, directory: Any) -> None:
        from convergent.models.llama import save_pretrained

        save_pretrained(model, directory)

    # pipeline support: a stage is a LlamaForCausalLM holding a slice of layers
    def stage_module(self, full: nn.Module, stage: int, n_stages: int) -> nn.Module:
        L = self.cfg.model.layers
        if n_stages > L:
            raise ConfigError(
                f"pipeline needs at least one layer per stage: {n_stages} stages > "
                f"model.layers={L}"
            )
        bounds = [round(i * L / n_stages) for i in range(n_stages + 1)]
        layers = range(bounds[stage], bounds[stage + 1])
        mod = self.build_model(layers=layers, embed=stage == 0, head=stage == n_stages - 1)
        own = mod.state_dict()
        src = full.state_dict()
        mod.load_state_dict({k: src[k] for k in own})
        return mod

    def pipeline_rounds(
        self, mb: MicroBatch, state: dict[str, Any], training: bool
    ) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
        state.clear()
        state.update(norm=mb.norm["tokens"])
        x, y = mb.data
        return [((x,), y)]

    def pipeline_loss(self, output: Any, target: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        return self.loss_from_logits(output, target, state["norm"])

    def pipeline_sums(
        self, state: dict[str, Any], mb: MicroBatch, last: bool, losses: list[torch.Tensor]
    ) -> dict[str, float]:
        done = float(last)
        ce_sum = sum(float(v) for v in losses) * state["norm"]
        return {"ce_sum": ce_sum * done, "tokens": mb.units * done,
                "samples": mb.samples * done, "units": mb.units * done}


# ----------------------------------------------------------------------------- molecular


class MolecularTask(Task):
    """Energies (eV) and forces (eV/Å) of molecules with :mod:`convergent.models`.

    Loss of a global batch: ``mean_molecules((E - E_ref)^2 / n_atoms^2)``... see
    :meth:`loss` — the exact form mirrors ``energy_force_loss`` of the models package
    but is computed from sums so that ranks' shares add up to the global-batch loss.
    """

    kind = "molecular"
    unit = "atoms"

    @property
    def pipeline_capable(self) -> bool:  # type: ignore[override]
        """Pipeline stages need direct forces (no double backward across stages)."""
        return self.cfg.model.forces == "direct"

    @property
    def double_backward(self) -> bool:
        """Autograd forces = -dE/dpositions are trained through the parameters."""
        return self.cfg.model.forces == "autograd"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        from convergent.train import moldata

        t = cfg.train
        if not t.dataset:
            raise ConfigError(
                "train.dataset is not set", hint="point it at a dataset directory"
            )
        self.data = moldata.MoleculeSource(t.dataset, cfg.data)
        self.val = moldata.MoleculeSource(t.val_dataset, cfg.data) if t.val_dataset else None
        # the plans of the 2 epochs last used, and every planned epoch's batch count: a
        # step finds its epoch from the counts without re-planning the earlier epochs
        self._epoch_cache: dict[tuple[int, int, int], list[list[int]]] = {}
        self._epoch_lens: dict[tuple[int, int, int], int] = {}
        self.refs: Any = None
        self._feed: Any = None  # molpipe.Feed of the pipeline strategy

    # delegated to moldata to keep this file readable
    def build_model(self) -> nn.Module:
        from convergent.train import moldata

        model = moldata.build(self.cfg, self.data)
        return model

    def global_budget(self, dp_world: int, accum: int) -> int:
        t = self.cfg.train
        return int(t.global_batch_atoms or t.batch_atoms * dp_world * accum)

    def epoch_plan(self, epoch: int, budget: int, parts: int) -> list[list[int]]:
        key = (epoch, budget, parts)
        plan = self._epoch_cache.get(key)
        if plan is None:
            from convergent.train import moldata

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
        from convergent.train import moldata

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
        from convergent.train import moldata

        return moldata.loss(model, mb, dp_world, self.cfg.train.force_weight, True)

    def finalize_stats(self, sums: dict[str, float]) -> dict[str, float]:
        from convergent.train import moldata

        return moldata.finalize(sums, self.cfg.train.force_weight)

    def val_batches(self, dp_rank: int, dp_world: int) -> list[MicroBatch]:
        from convergent.train import moldata

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
        from convergent.train import moldata

        _, stats = moldata.loss(model, mb, 1, self.cfg.train.force_weight, False)
        return stats

    def export(self, model: nn.Module, directory: Any) -> None:
        from convergent.train import moldata

        moldata.export(model, self.cfg, directory)

    # pipeline support (model.forces=direct): see convergent.train.molpipe
    def feed(self) -> Any:
        """This rank's padded pipeline micro-batches (created with the first stage)."""
        from convergent.train import molpipe

        if self._feed is None:
            counts = list(self.data.atom_counts) + (self.val.atom_counts if self.val else [])
            budget = molpipe.Budget.plan(
                self.global_budget(1, 1), max(counts), self.cfg.parallel.microbatches,
                self.cfg.model.max_neighbors,
            )
            self._feed = molpipe.Feed(budget)
        return self._feed

    def stage_module(self, full: nn.Module, stage: int, n_stages: int) -> nn.Module:
        from convergent.train import molpipe

        return molpipe.stage_module(full, stage, n_stages, self.feed())

    def stage_io(self, stage: int, n_stages: int, device: torch.device) -> Any:
        from convergent.train import molpipe

        return molpipe.stage_io(
            self.feed().budget, self.cfg.model.state_width, stage == 0, stage == n_stages - 1, device
        )

    def pipeline_rounds(
        self, mb: MicroBatch, state: dict[str, Any], training: bool
    ) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
        from convergent.train import molpipe

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
        from convergent.train import molpipe

        loss, stats = molpipe.padded_loss(
            output, self.feed()[target], state["norm"], self.cfg.train.force_weight
        )
        state["stats"][int(target.reshape(-1)[0])] = stats
        return loss

    def pipeline_sums(
        self, state: dict[str, Any], mb: MicroBatch, last: bool, losses: list[torch.Tensor]
    ) -> dict[str, float]:
        from convergent.train.moldata import STAT_KEYS

        done = float(last)
        sums = {k: sum(s.get(k, 0.0) for s in state["stats"].values()) * done for k in STAT_KEYS}
        return {**sums, "samples": mb.samples * done, "units": mb.units * done}


def make_task(cfg: Any) -> Task:
    """The task for ``cfg.model.kind``: ``molecular`` or ``llama``."""
    if cfg.model.kind == "llama" and cfg.text.source:  # a real text corpus
        from convergent.train.texttask import TextLMTask

        return TextLMTask(cfg)
    return LMTask(cfg) if cfg.model.kind == "llama" else MolecularTask(cfg)


def iterate_steps(start: int, steps: int) -> Iterator[int]:
    yield from range(start, steps)
