"""Config of active learning (``learn`` section): rounds, committee, pool, MD, selection.

Every default runs a small campaign on a 2-core laptop. Units: Å, eV, K, fs, s.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from convergent.configbase import (
    Count,
    Count0,
    Fraction,
    NonNegative,
    PathStr,
    Positive,
    Section,
    Seed,
)


class LearnConfig(Section):
    """An active-learning campaign on one shared Dask pool.

    Each round trains a committee of ``committee`` surrogates (warm-started from the last
    round), proposes candidates from the unlabelled ``pool`` (``nci`` | ``g2`` | ``s22`` |
    an .xyz/.extxyz path | ``smiles:<file>``; ``pool_conformers`` rattled copies of each
    molecule) and from short surrogate-driven Langevin MD (``md_trajectories`` per round
    from labelled structures), scores them by committee disagreement (``bootstrap``: each
    member trains on its own resample of the labels), selects ``batch``
    by ``strategy`` (``uncertainty``: highest score first with no two structures of one
    batch within ``diversity_tol`` Å of each other, nor within ``labelled_tol`` Å of a
    structure already labelled; ``acquisition: power`` walks the candidates in a seeded
    draw ∝ score**``power_beta`` instead of strictly by score; ``acquisition: posterior``
    takes greedily the largest score**``posterior_alpha`` times a gain under a Bayesian
    linear model on the committee's last-layer features, fitted to the labels and
    conditioned on each pick (``posterior_gain``: ``pool``, how much the candidate's label
    lowers the mean posterior variance over all candidates, or ``variance``, its own);
    ``random``: a seeded random draw),
    labels them on Dask and appends them with provenance. Stops at ``label_budget``
    labels, ``wall_budget_s`` seconds (0: off), ``target_energy_mae`` eV/atom on the
    held-out set (0: off) or after ``rounds`` rounds. ``pipelined``: exploration and
    evaluation fill the cores the critical path leaves idle (false: strict phases).
    """

    rounds: Count = 3
    committee: Count = 2  # K surrogates per round
    strategy: Literal["uncertainty", "random"] = "uncertainty"
    pipelined: bool = True
    # pool: the unlabelled structures, and the held-out molecules for the learning curve
    pool: str = Field("g2", min_length=1)
    elements: list[str] = ["C", "H", "N", "O"]
    max_atoms: Count = 12
    min_atoms: Count = 2
    max_molecules: Count | None = None
    pool_conformers: Count = 6  # rattled copies per molecule
    pool_sigma: Positive = 0.05  # Å, largest rattle of a pool conformer
    pool_sample: Count0 = 0  # pool candidates scored per round (0: all)
    holdout_fraction: Fraction = 0.2  # of molecules, never in the pool
    holdout_per_molecule: Count = 2  # labelled held-out structures per molecule
    # labelling
    init_labels: Count = 12  # random pool structures labelled before round 1
    batch: Count = 8  # labels selected per round
    label_budget: Count = 64  # total labels (init + selected), held-out set excluded
    label_chunk: Count = 2  # structures per label task
    label_retries: Count0 = 1
    calculator: Literal["xtb", "dft", "emt"] = "xtb"
    dft_from_round: Count0 = 0  # 0: never; else label with PySCF from this round on
    min_distance: NonNegative = 0.5  # Å; closer atoms are quarantined
    max_force: NonNegative = 50.0  # eV/Å; labels with a larger force are quarantined (0: off)
    # committee training (same compute per round for every strategy)
    train_steps: Count = 60  # optimiser steps per member per round
    first_train_steps: Count = 120  # steps of a cold start (round 1)
    lr: Positive = 2e-3
    batch_atoms: Count = 256
    force_weight: NonNegative = 1.0  # as the demo: weight 10 starved the energy (README table)
    train_retries: Count0 = 2
    refit_reference: bool = True  # warm starts refit the element reference energies
    # bagging: each member trains on its own seeded resample (with replacement) of the
    # labels, element references included, so the committee disagrees where labels are thin
    bootstrap: bool = False
    init_model: PathStr | None = None  # warm start of round 1 (a saved model directory)
    init_dataset: PathStr | None = None  # already labelled structures (counted as labels)
    # exploration: short Langevin MD driven by the committee's mean
    md_trajectories: Count0 = 4  # per round
    md_steps: Count = 40
    md_interval: Count = 10  # steps between candidate frames
    md_temperature: Positive = 600.0  # K
    md_timestep_fs: Positive = 0.5
    md_friction: Positive = 0.02  # 1/fs
    # scoring and selection
    score_chunk: Count = 64  # candidates per scoring task
    # score = E_std/atom + w * max-atom F_std; 0.02 puts the two spreads on one scale (a
    # force-dominated score picks the most distorted structures, bench/active_learning.py)
    force_weight_score: NonNegative = 0.02
    diversity_tol: NonNegative = 0.05  # Å, sorted-distance fingerprint tolerance
    labelled_tol: NonNegative = 0.0  # Å; > 0: skip candidates this close to a labelled structure
    # top: strictly by score; power: a seeded draw with probability ∝ score**power_beta;
    # posterior: greedy by score**posterior_alpha x a gain (posterior_gain) under the
    # committee's last-layer posterior, conditioned on each pick (convergent.learn.posterior)
    acquisition: Literal["top", "power", "posterior"] = "posterior"
    power_beta: float = Field(1.0, gt=0, le=20, allow_inf_nan=False)
    posterior_alpha: float = Field(1.0, ge=0, le=8, allow_inf_nan=False)
    posterior_ridge: float = Field(1.0, gt=0, le=1e6, allow_inf_nan=False)
    # variance: the candidate's own posterior variance; pool: how much its label lowers the
    # mean posterior variance over every candidate (the pool stands in for the held-out set)
    posterior_gain: Literal["variance", "pool"] = "pool"
    max_per_molecule: Count0 = 0  # 0: no limit per molecule in one batch
    # stopping
    wall_budget_s: NonNegative = 0.0
    target_energy_mae: NonNegative = 0.0  # eV/atom on the held-out set
    device: Literal["auto", "cpu", "cuda"] = "auto"  # training/MD place (GPU = Dask resource)
    seed: Seed = 0

    @model_validator(mode="after")
    def _ranges(self) -> LearnConfig:
        if self.min_atoms > self.max_atoms:
            raise ValueError(f"learn.min_atoms ({self.min_atoms}) must be <= learn.max_atoms ({self.max_atoms})")
        if self.init_labels > self.label_budget and self.init_dataset is None:
            raise ValueError("learn.init_labels must be <= learn.label_budget")
        return self
