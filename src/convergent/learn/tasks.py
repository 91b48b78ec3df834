"""Worker side of a campaign: the task kinds that share the Dask pool.

* ``train``  — one committee member: a seeded run of ``steps`` optimiser steps on the
  labelled set (records sorted by key, so the result does not depend on arrival order),
  warm-started from the previous round's member; saved with ``models.io.save_model``.
* ``score``  — committee predictions of a chunk of candidates (energy spread and the
  largest per-atom force spread, :func:`convergent.screen.predict.predict_records`).
* ``explore`` — one short Langevin trajectory driven by the committee's mean
  (:class:`convergent.models.calculator.SurrogateCalculator`), frames kept as candidates.
* ``label``  — reference single points (:func:`convergent.sim.worker.execute_task`):
  records, and quarantine entries for structures that fail.
* ``eval``   — held-out energy/force errors of a committee.

Every task returns :class:`Timed`: its value and a :class:`Span` (kind, start/end wall
time, worker, pid, device), from which the driver writes the timeline.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Span:
    """When and where one task ran (wall-clock seconds since the epoch)."""

    kind: str
    name: str
    start: float
    end: float
    worker: str
    pid: int
    device: str = "cpu"
    round: int = 0
    ok: bool = True


@dataclass
class Timed:
    value: Any
    span: Span
    extra: dict[str, Any] = field(default_factory=dict)


def _worker_address() -> str:
    try:
        from distributed import get_worker

        return get_worker().address
    except (ImportError, ValueError):
        return f"local-{os.getpid()}"


def _torch_setup(device: str):
    import torch

    torch.set_num_threads(1)
    if device == "cuda" and not torch.cuda.is_available():
        device = "cpu"
    return torch, device


def timed(kind: str, name: str, rnd: int, device: str, fn, *args: Any) -> Timed:
    """Run ``fn(*args)`` and wrap its value with its :class:`Span`."""
    t0 = time.time()
    value = fn(*args)
    return Timed(value, Span(kind, name, t0, time.time(), _worker_address(), os.getpid(), device, rnd))


# ------------------------------------------------------------------------------- train


def _fault_once(marker: str | None) -> None:
    """Test hook: the first task to see a missing ``marker`` file creates it and kills its
    worker process (a real crash, as the driver sees it: KilledWorker)."""
    if marker and not Path(marker).exists():
        Path(marker).write_text(str(os.getpid()))
        os._exit(13)


def train_member(dataset: str, extra_datasets: list[str], model_cfg: dict[str, Any],
                 init_dir: str | None, out_dir: str, steps: int, lr: float, batch_atoms: int,
                 force_weight: float, seed: int, device: str = "cpu",
                 fault_marker: str | None = None, refit_reference: bool = False,
                 bootstrap: bool = False) -> dict[str, Any]:
    """Train one member and save it to ``out_dir``; returns its training summary.
    ``bootstrap``: on a resample of the labels drawn with replacement (seeded by ``seed``)."""
    torch, device = _torch_setup(device)
    from convergent.data.reader import open_dataset
    from convergent.models.batching import batches_by_atom_budget, collate_records
    from convergent.models.config import ModelConfig
    from convergent.models.io import load_model, save_model
    from convergent.models.losses import energy_force_loss
    from convergent.models.molecular import build_model, energy_and_forces, fit_reference_energies

    _fault_once(fault_marker)
    from convergent.data.format import MANIFEST_NAME

    records = []
    for path in [dataset, *extra_datasets]:
        if not (Path(path) / MANIFEST_NAME).is_file():
            continue  # no labels of this campaign yet (warm start from a given dataset)
        ds = open_dataset(path)
        try:
            records += [ds[i] for i in range(len(ds))]
        finally:
            ds.close()
    records.sort(key=lambda r: r["key"])
    if not records:
        raise ValueError("no labelled structures to train on")
    if bootstrap:
        draw = np.random.default_rng(seed).integers(0, len(records), len(records))
        records = _keep_every_element(records, [records[i] for i in np.sort(draw)])
    torch.manual_seed(seed)
    cfg = ModelConfig.model_validate(model_cfg)
    if init_dir:
        model, cfg = load_model(init_dir, "cpu")
        if refit_reference:  # element references from every label so far (least squares)
            model.set_reference(fit_reference_energies(records))
    else:
        model = build_model(cfg)
        model.set_reference(fit_reference_energies(records))
    model.to(device).train(True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    counts = [len(r["numbers"]) for r in records]
    t0, step, epoch, losses = time.perf_counter(), 0, 0, []
    while step < steps:
        for idx in batches_by_atom_budget(counts, batch_atoms, shuffle_seed=seed * 7919 + epoch):
            if step >= steps:
                break
            for g in opt.param_groups:
                g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
            batch = collate_records([records[i] for i in idx]).to(device)
            e, f = energy_and_forces(model, batch, training=True)
            loss, _ = energy_force_loss(e, f, batch, force_weight=force_weight)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"training diverged at step {step}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 10.0)
            opt.step()
            losses.append(float(loss.detach()))
            step += 1
        epoch += 1
    model.to("cpu").eval()
    model.trained_elements = tuple(sorted({int(z) for r in records for z in r["numbers"]}
                                          | set(getattr(model, "trained_elements", None) or ())))
    summary = {"steps": step, "records": len(records), "bootstrap": bootstrap, "final_loss": float(np.mean(losses[-10:])),
               "seconds": time.perf_counter() - t0, "warm_start": bool(init_dir), "seed": seed}
    save_model(model, cfg, out_dir, extra={"learn": summary})
    return summary


def _keep_every_element(records: list[dict[str, Any]], drawn: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A bootstrap resample plus, for each element the draw missed, the first record (by
    key) holding it: every member learns (and records) every element of the labels."""
    have = {int(z) for r in drawn for z in r["numbers"]}
    extra = []
    for r in records:
        new = {int(z) for z in r["numbers"]} - have
        if new:
            extra.append(r)
            have |= new
    return drawn + extra


# ------------------------------------------------------------------------------- score


def _models(model_dirs: list[str], device: str):
    from convergent.screen.predict import load_ensemble

    return load_ensemble([Path(d) for d in model_dirs], device)


def score_records(model_dirs: list[str], records: list[dict[str, Any]], batch_atoms: int,
                  device: str = "cpu", elements: list[int] | None = None) -> dict[str, list[Any]]:
    """Committee mean energy, energy spread (eV) and largest force spread (eV/Å); with
    ``elements``, also each structure's last-layer features
    (:func:`convergent.learn.posterior.structure_features`)."""
    _, device = _torch_setup(device)
    from convergent.screen.predict import predict_records

    models = _models(model_dirs, device)
    res = predict_records(models, records, batch_atoms, device)
    out: dict[str, list[Any]] = {"energy_pred": res.energy_pred.tolist(), "energy_std": res.energy_std.tolist(),
                                 "force_std_max": res.force_std_max.tolist(), "n_atoms": res.n_atoms.tolist()}
    if elements is not None:
        from convergent.learn.posterior import structure_features

        out["features"] = structure_features(models, records, batch_atoms, device, elements).tolist()
    return out


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


def explore_md(model_dirs: list[str], start: dict[str, Any], steps: int, interval: int,
               temperature: float, timestep_fs: float, friction: float, seed: int,
               min_distance: float = 0.6, device: str = "cpu") -> list[dict[str, Any]]:
    """One Langevin trajectory on the committee mean; every ``interval`` steps a frame
    ``{positions, step, energy_std, force_std_max}``. Stops early (keeping what it has)
    when atoms come closer than ``min_distance`` Å or fly apart (a surrogate artefact)."""
    _, device = _torch_setup(device)
    from ase import Atoms, units
    from ase.md.langevin import Langevin
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution

    from convergent.models.calculator import SurrogateCalculator

    atoms = Atoms(numbers=start["numbers"], positions=start["positions"])
    atoms.calc = SurrogateCalculator(_models(model_dirs, device), device=device)
    rng = np.random.default_rng(seed)
    MaxwellBoltzmannDistribution(atoms, temperature_K=temperature, rng=rng)
    dyn = Langevin(atoms, timestep_fs * units.fs, temperature_K=temperature,
                   friction=friction / units.fs, rng=rng, fixcm=False)
    frames: list[dict[str, Any]] = []
    for step in range(interval, steps + 1, interval):
        dyn.run(interval)
        pos = atoms.get_positions()
        d = np.sqrt(((pos[:, None] - pos[None]) ** 2).sum(-1)) + np.eye(len(pos)) * 1e3
        if d.min() < min_distance or (len(pos) > 1 and d.min(1).max() > 4.0):
            break
        res = atoms.calc.results
        frames.append({"positions": pos.copy(), "step": step,
                       "energy_std": float(res.get("energy_std", float("nan"))),
                       "force_std_max": float(np.max(res.get("forces_std", [float("nan")])))})
    return frames


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
