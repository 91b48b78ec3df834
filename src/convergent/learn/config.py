"""Config of active learning (``learn`` section), nested by concern: the pool, labelling,
the committee's members, surrogate-MD exploration and selection.

Nothing here repeats another section: the pool's molecules come from the ``simulate``
section's source filter (``simulate.source``, ``elements``, ``min_atoms``, ``max_atoms``,
``max_molecules``; conformers rattled by ``simulate.rattle_sigma``), labels are computed
with its calculator (``simulate.calculator``, ``method``, ``basis``, the ``xtb_*``
settings; geometries closer than ``simulate.min_distance`` quarantined), and each member
is a ``convergent train`` run of the ``train`` section (``train.steps`` per round,
``train.lr``, ``train.batch_atoms``, ``train.force_weight``; ``convergent learn`` starts
from :data:`LEARN_PRESET` under the user's YAML and ``--set``). A key of the flat
layout this replaced is refused in one line naming its new place (:data:`MOVED_KEYS`).

Every default runs a small campaign on a 2-core laptop. Units: Å, eV, K, fs, s.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from convergent.core.configbase import (
    Count,
    Count0,
    Fraction,
    NonNegative,
    PathStr,
    Positive,
    Section,
    Seed,
)

# `convergent learn`'s own defaults for the sections it shares (config.load_config's
# ``preset``): members are short warm-started runs on a few hundred atoms per batch.
LEARN_PRESET: dict[str, Any] = {
    "train": {"steps": 60, "lr": 2e-3, "batch_atoms": 256, "force_weight": 1.0}}


class PoolConfig(Section):
    """The unlabelled pool and the held-out molecules of the learning curve: ``conformers``
    rattled copies of each molecule of ``simulate.source``; ``holdout_fraction`` of the
    molecules never enter the pool, ``holdout_per_molecule`` of their conformers are
    labelled as the held-out set; ``sample`` candidates scored per round (0: all)."""

    conformers: Count = 6
    sample: Count0 = 0
    holdout_fraction: Fraction = 0.2
    holdout_per_molecule: Count = 2


class LabelConfig(Section):
    """Labelling with the ``simulate`` section's calculator: ``init`` random pool structures
    before round 1, ``batch`` selected per round, ``budget`` in all (held-out set excluded;
    ``init_dataset``'s structures count), ``chunk`` structures per task, ``retries`` per
    task; from round ``dft_from_round`` on (0: never) PySCF instead; labels whose largest
    force exceeds ``max_force`` eV/Å are quarantined (0: off)."""

    init: Count = 12
    batch: Count = 8
    budget: Count = 64
    chunk: Count = 2
    retries: Count0 = 1
    dft_from_round: Count0 = 0
    max_force: NonNegative = 50.0
    init_dataset: PathStr | None = None  # already labelled structures (counted as labels)


class MembersConfig(Section):
    """The committee's members (``train`` section runs): ``first_round_steps`` for a cold
    start (round 1 without ``init_model``), ``train.steps`` otherwise; ``retries`` per
    crashed member; warm starts refit the element references (``refit_reference``);
    ``bootstrap``: each member trains on its own seeded resample of the labels (element
    references included), so the committee disagrees where labels are thin."""

    first_round_steps: Count = 120
    retries: Count0 = 2
    refit_reference: bool = True
    bootstrap: bool = False
    init_model: PathStr | None = None  # warm start of round 1 (a saved model directory)


class ExploreConfig(Section):
    """Short Langevin MD driven by the committee's mean from labelled structures:
    ``trajectories`` per round of ``steps`` steps, a candidate frame every ``interval``;
    ``chunk`` trajectories per task (batched MD), so the next round's exploration is
    several low-priority tasks that fill whichever cores the critical path leaves idle."""

    trajectories: Count0 = 4
    chunk: Count = 2
    steps: Count = 40
    interval: Count = 10
    temperature: Positive = 600.0  # K
    timestep_fs: Positive = 0.5
    friction: Positive = 0.02  # 1/fs


class SelectConfig(Section):
    """Scoring and batch selection. Score = energy spread per atom + ``force_weight`` x the
    largest per-atom force spread (0.02 puts the two on one scale; a force-dominated score
    picks the most distorted structures, bench/learn/active_learning.py), in tasks of
    ``score_chunk`` candidates. ``strategy``: ``uncertainty`` (no two structures of a batch
    within ``diversity_tol`` Å of each other, nor within ``labelled_tol`` Å of a labelled
    one; at most ``max_per_molecule`` per molecule, 0: no limit) or ``random`` (a seeded
    draw). ``acquisition``: ``top`` (by score), ``power`` (a seeded draw ∝
    score**``power_beta``) or ``posterior`` (greedy by score**``posterior_alpha`` x a gain
    under the committee's last-layer posterior, conditioned on each pick; ``posterior_gain``
    ``pool``: how much the label lowers the mean posterior variance over every candidate,
    ``variance``: the candidate's own; convergent.learn.posterior)."""

    strategy: Literal["uncertainty", "random"] = "uncertainty"
    score_chunk: Count = 64
    force_weight: NonNegative = 0.02
    diversity_tol: NonNegative = 0.05  # Å, sorted-distance fingerprint tolerance
    labelled_tol: NonNegative = 0.0  # Å; > 0: skip candidates this close to a labelled one
    max_per_molecule: Count0 = 0
    acquisition: Literal["top", "power", "posterior"] = "posterior"
    power_beta: float = Field(1.0, gt=0, le=20, allow_inf_nan=False)
    posterior_alpha: float = Field(1.0, ge=0, le=8, allow_inf_nan=False)
    posterior_ridge: float = Field(1.0, gt=0, le=1e6, allow_inf_nan=False)
    posterior_gain: Literal["variance", "pool"] = "pool"


class LearnConfig(Section):
    """An active-learning campaign on one shared Dask pool.

    Each round trains a committee of ``committee`` members (warm-started from the last
    round), proposes candidates from the pool and from surrogate MD, scores them by
    committee disagreement, selects a batch and labels it on Dask with provenance. Stops
    at ``label.budget`` labels, ``wall_budget_s`` seconds (0: off), ``target_energy_mae``
    eV/atom on the held-out set (0: off) or after ``rounds`` rounds. ``pipelined``:
    exploration and evaluation fill the cores the critical path leaves idle (false: strict
    phases). ``device``: where members train and MD runs (a GPU is a Dask resource).
    """

    rounds: Count = 3
    committee: Count = 2
    pipelined: bool = True
    wall_budget_s: NonNegative = 0.0
    target_energy_mae: NonNegative = 0.0  # eV/atom on the held-out set
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: Seed = 0
    pool: PoolConfig = PoolConfig()
    label: LabelConfig = LabelConfig()
    members: MembersConfig = MembersConfig()
    explore: ExploreConfig = ExploreConfig()
    select: SelectConfig = SelectConfig()

    @model_validator(mode="after")
    def _ranges(self) -> LearnConfig:
        if self.label.init > self.label.budget and self.label.init_dataset is None:
            raise ValueError("learn.label.init must be <= learn.label.budget")
        return self


# The flat layout's keys and where each went (config.load_config refuses them by name).
MOVED_KEYS: dict[str, str] = {
    "learn.pool": "simulate.source", "learn.elements": "simulate.elements",
    "learn.max_atoms": "simulate.max_atoms", "learn.min_atoms": "simulate.min_atoms",
    "learn.max_molecules": "simulate.max_molecules", "learn.pool_sigma": "simulate.rattle_sigma",
    "learn.pool_conformers": "learn.pool.conformers", "learn.pool_sample": "learn.pool.sample",
    "learn.holdout_fraction": "learn.pool.holdout_fraction",
    "learn.holdout_per_molecule": "learn.pool.holdout_per_molecule",
    "learn.init_labels": "learn.label.init", "learn.batch": "learn.label.batch",
    "learn.label_budget": "learn.label.budget", "learn.label_chunk": "learn.label.chunk",
    "learn.label_retries": "learn.label.retries", "learn.calculator": "simulate.calculator",
    "learn.dft_from_round": "learn.label.dft_from_round",
    "learn.min_distance": "simulate.min_distance", "learn.max_force": "learn.label.max_force",
    "learn.init_dataset": "learn.label.init_dataset",
    "learn.train_steps": "train.steps", "learn.first_train_steps": "learn.members.first_round_steps",
    "learn.lr": "train.lr", "learn.batch_atoms": "train.batch_atoms",
    "learn.force_weight": "train.force_weight", "learn.train_retries": "learn.members.retries",
    "learn.refit_reference": "learn.members.refit_reference",
    "learn.bootstrap": "learn.members.bootstrap", "learn.init_model": "learn.members.init_model",
    "learn.md_trajectories": "learn.explore.trajectories", "learn.md_steps": "learn.explore.steps",
    "learn.md_interval": "learn.explore.interval",
    "learn.md_temperature": "learn.explore.temperature",
    "learn.md_timestep_fs": "learn.explore.timestep_fs",
    "learn.md_friction": "learn.explore.friction",
    "learn.strategy": "learn.select.strategy", "learn.score_chunk": "learn.select.score_chunk",
    "learn.force_weight_score": "learn.select.force_weight",
    "learn.diversity_tol": "learn.select.diversity_tol",
    "learn.labelled_tol": "learn.select.labelled_tol",
    "learn.max_per_molecule": "learn.select.max_per_molecule",
    "learn.acquisition": "learn.select.acquisition", "learn.power_beta": "learn.select.power_beta",
    "learn.posterior_alpha": "learn.select.posterior_alpha",
    "learn.posterior_ridge": "learn.select.posterior_ridge",
    "learn.posterior_gain": "learn.select.posterior_gain",
}
