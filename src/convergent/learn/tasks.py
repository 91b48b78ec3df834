"""Worker side of a campaign: the task kinds that share the Dask pool.

* ``train``  — one committee member: a seeded run of ``steps`` optimiser steps on the
  labelled set (records sorted by key, so the result does not depend on arrival order),
  warm-started from the previous round's member; saved with ``models.io.save_model``.
* ``score``  — one member's predictions of a chunk of candidates (energies, forces and
  last-layer features, :func:`member_predict`), combined over the committee by the
  driver (:func:`combine`: energy spread and the largest per-atom force spread).
* ``explore`` — one short Langevin trajectory driven by the committee's mean
  (:class:`convergent.models.calculator.SurrogateCalculator`), frames kept as candidates.
* ``label``  — reference single points (:func:`convergent.sim.worker.execute_task`):
  records, and quarantine entries for structures that fail.
* ``eval``   — held-out energy/force errors of a committee.

The driver runs them on :class:`convergent.learn.engine.Pool` (the task farm of
:mod:`convergent.sim.taskfarm`), which times each one and writes the timeline.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


def _torch_setup(device: str):
    import torch

    torch.set_num_threads(1)
    if device == "cuda" and not torch.cuda.is_available():
        device = "cpu"
    return torch, device


# ------------------------------------------------------------------------------- train


def _fault_once(marker: str | None) -> None:
    """Test hook: the first task to see a missing ``marker`` file creates it and kills its
    worker process (a real crash, as the driver sees it: KilledWorker)."""
    if marker and not Path(marker).exists():
        Path(marker).write_text(str(os.getpid()))
        os._exit(13)


@dataclass(frozen=True)
class MemberJob:
    """One committee member's training: a whole config (model, train, precision: the
    settings a ``convergent train`` run with the same data would have), where to save the
    model, and the test hook."""

    config: dict[str, Any]  # ConvergentConfig.model_dump(mode="json")
    out_dir: str
    fault_marker: str | None = None


def member_config(base: Any, train: Any) -> dict[str, Any]:
    """A member's whole config: ``base``'s model and precision (a ConvergentConfig) and
    ``train`` (a TrainConfig: data, steps, lr, seed, ...) with the committee's fixed
    choices — records sorted by key (arrival order does not matter), cosine to zero
    without warm-up, gradients clipped at 10, one process with one thread, no
    validation, no checkpoint (the model is exported from memory), no sinks but the
    member's metrics.jsonl, no MFU. (:func:`train_member` puts it on the pool's device.)"""
    from convergent.monitor.config import MetricsConfig
    from convergent.tracking.config import TrackingConfig
    from convergent.train.config import CheckpointConfig, ParallelConfig

    train = train.model_copy(update={
        "record_order": "key", "warmup_steps": 0, "min_lr_ratio": 0.0, "lr_schedule": "cosine",
        "grad_clip": 10.0, "threads": 1, "device": "cpu", "val_every": 0, "val_dataset": None,
        "prefetch": 0, "grad_accum": 1})
    cfg = base.model_copy(update={
        "train": train, "parallel": ParallelConfig(),
        "checkpoint": CheckpointConfig(interval=0, keep=1, resume=False, at_end=False),
        "metrics": MetricsConfig(tensorboard=False, mfu=False), "tracking": TrackingConfig()})
    return cfg.model_dump(mode="json")


def train_member(job: MemberJob, device: str = "cpu") -> dict[str, Any]:
    """Train one member with the one training loop (:func:`convergent.train.fit.fit`, the
    Trainer of ``convergent train`` in this process) on ``device`` (the pool's place for
    training: ``cuda`` on a GPU worker when torch sees one, else the CPU) and save it to
    ``job.out_dir``; its metrics stay in ``<out_dir>/train/metrics.jsonl``. Returns its
    training summary."""
    _, device = _torch_setup(device)
    _fault_once(job.fault_marker)
    from convergent.config import ConvergentConfig
    from convergent.train.fit import fit

    config = {**job.config, "train": {**job.config["train"], "device": device}}
    cfg = ConvergentConfig.model_validate(config)
    out = Path(job.out_dir)
    t0 = time.perf_counter()
    summary = fit(cfg, out / "train", export_to=out)
    final = summary.get("final") or {}
    t = cfg.train
    return {"steps": summary["steps"], "records": summary.get("train_records"),
            "bootstrap": t.bootstrap, "seed": t.seed,
            "final_loss": final.get("loss"), "seconds": time.perf_counter() - t0,
            "warm_start": bool(t.init_from)}


# ------------------------------------------------------------------------------- score


def _models(model_dirs: list[str], device: str):
    from convergent.screen.predict import load_ensemble

    return load_ensemble([Path(d) for d in model_dirs], device)


def member_predict(model_dir: str, records: list[dict[str, Any]], batch_atoms: int, device: str = "cpu",
                   elements: list[int] | None = None) -> dict[str, Any]:
    """One committee member on ``records``: ``energy`` (eV, per structure), ``forces``
    (eV/Å, every atom in structure order), ``n_atoms`` and, with ``elements``, its
    last-layer ``features`` (:func:`convergent.learn.posterior.structure_features`, without
    the element fractions: :func:`combine` adds them once)."""
    _, device = _torch_setup(device)
    from convergent.screen.predict import predict_records

    models = _models([model_dir], device)
    res = predict_records(models, records, batch_atoms, device, keep_atoms=True)
    out = {"energy": np.asarray(res.energy_pred, np.float64), "n_atoms": np.asarray(res.n_atoms),
           "forces": np.asarray(res.forces_pred, np.float64).reshape(-1, 3), "features": None}
    if elements is not None:
        from convergent.learn.posterior import structure_features

        out["features"] = structure_features(models, records, batch_atoms, device, [])
    return out


def combine(parts: list[dict[str, Any]], records: list[dict[str, Any]],
            elements: list[int] | None = None) -> dict[str, np.ndarray]:
    """The committee from its members' :func:`member_predict` on the same ``records``:
    ``energy_pred`` (the mean), ``energy_std`` (sample std over members, eV; NaN for one
    member), ``force_std_max`` (per structure, the largest per-atom norm of the force
    sample std, eV/Å), ``n_atoms`` and, with ``elements``, ``features``: the members'
    side by side, then the element fractions."""
    from convergent.learn.posterior import structure_features

    e = np.stack([p["energy"] for p in parts])  # [K, S]
    n = np.asarray(parts[0]["n_atoms"], np.int64)
    s = len(n)
    e_std, f_max = np.full(s, np.nan), np.full(s, np.nan)
    if len(parts) > 1:
        e_std = e.std(0, ddof=1)
        per_atom = np.linalg.norm(np.stack([p["forces"] for p in parts]).std(0, ddof=1), axis=1)
        f_max = np.zeros(s)
        np.maximum.at(f_max, np.repeat(np.arange(s), n), per_atom)
    out = {"energy_pred": e.mean(0), "energy_std": e_std, "force_std_max": f_max, "n_atoms": n.astype(np.float64)}
    if elements is not None:
        out["features"] = np.concatenate([*(p["features"] for p in parts),
                                          structure_features([], records, 1, "cpu", elements)], axis=1)
    return out


def score_records(model_dirs: list[str], records: list[dict[str, Any]], batch_atoms: int,
                  device: str = "cpu", elements: list[int] | None = None) -> dict[str, list[Any]]:
    """Committee mean energy, energy spread (eV) and largest force spread (eV/Å) of
    ``records`` in one task (:func:`combine` of each member's :func:`member_predict`); with
    ``elements``, also each structure's last-layer features."""
    parts = [member_predict(d, records, batch_atoms, device, elements) for d in model_dirs]
    return {k: v.tolist() for k, v in combine(parts, records, elements).items()}


def evaluate(model_dirs: list[str], dataset: str, batch_atoms: int, device: str = "cpu") -> dict[str, float]:
    """Held-out errors of the committee mean: energy MAE (eV, eV/atom), force MAE (eV/Å)."""
    _, device = _torch_setup(device)
    from convergent.screen.predict import predict_dataset

    res = predict_dataset([Path(d) for d in model_dirs], dataset, batch_atoms, device)
    n = res.n_atoms.astype(float)
    base = res.baseline_energy_mae  # the per-element baseline: first member's element fit
    return {"energy_mae": res.energy_mae,
            "energy_mae_per_atom": float(np.abs((res.energy_pred - res.energy_true) / n).mean()),
            "force_mae": res.force_mae_total, "structures": len(res),
            "baseline_energy_mae": base if np.isfinite(base) else None,
            "baseline_energy_mae_per_atom": (
                float(np.nanmean(np.abs((res.baseline_pred - res.energy_true) / n)))
                if np.isfinite(base) else None)}


# ----------------------------------------------------------------------------- explore


def explore_md(model_dirs: list[str], starts: list[dict[str, Any]], steps: int, interval: int,
               temperature: float, timestep_fs: float, friction: float, seeds: list[int],
               min_distance: float = 0.6, device: str = "cpu") -> list[list[dict[str, Any]]]:
    """Langevin trajectories on the committee mean from every start at once (batched MD,
    :class:`convergent.screen.batchmd.BatchMD`: one committee call a step for all of them,
    start ``j`` with its own random stream seeded ``seeds[j]``); per start, every
    ``interval`` steps a frame ``{positions, step, energy_std, force_std_max}``. A
    trajectory stops early (keeping what it has) when atoms come closer than
    ``min_distance`` Å or fly apart (a surrogate artefact)."""
    _, device = _torch_setup(device)
    from convergent.screen.batchmd import BatchMD, MDSettings, too_close_or_apart

    md = BatchMD(_models(model_dirs, device), [s["numbers"] for s in starts],
                 [s["positions"] for s in starts],
                 MDSettings(temperature_K=temperature, timestep_fs=timestep_fs,
                            friction_per_fs=friction),
                 [np.random.default_rng(seed) for seed in seeds],
                 check=too_close_or_apart(min_distance), device=device)
    out = []
    for t in md.run(steps, interval):
        out.append([{"positions": p, "step": k, "energy_std": es, "force_std_max": fs}
                    for p, k, es, fs in zip(t.positions, t.steps, t.energy_std, t.force_std_max,
                                            strict=True)
                    if 0 < k and k != t.failed_step])
    return out


# ------------------------------------------------------------------------------- label


def label_items(items: list[dict[str, Any]], calc: dict[str, Any], min_distance: float,
                timeout_s: float = 0.0):
    """Reference labels of ``items`` (via the simulation campaign's worker code)."""
    from convergent.sim.calculators import CalcSpec
    from convergent.sim.tasks import FrameItem, FramesTask
    from convergent.sim.worker import execute_task

    spec = CalcSpec(**calc)
    frames = [FrameItem(it["key"], it["molecule_id"], np.asarray(it["numbers"], np.int64),
                        np.asarray(it["positions"], np.float64), int(it["charge"]),
                        int(it["multiplicity"]), dict(it["meta"])) for it in items]
    return execute_task(FramesTask("learn", frames, spec, min_distance, timeout_s))
