"""Energy + force loss for the molecular surrogate (eV, eV/Å)."""

from __future__ import annotations

import torch

from convergent.models.batching import AtomsBatch


def energy_force_loss(
    energy: torch.Tensor,
    forces: torch.Tensor | None,
    batch: AtomsBatch,
    force_weight: float = 10.0,
    per_atom_energy: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted MSE loss and MAE metrics.

    ``loss = mean((ΔE / n_atoms)²) + force_weight · mean(ΔF²)`` (eV²-ish units; with
    ``per_atom_energy=False`` the energy term is ``mean(ΔE²)``). ``energy`` float[B] eV,
    ``forces`` float[N,3] eV/Å (None or ``force_weight=0`` trains on energies only).
    Returns ``(loss fp32 scalar, {"energy_mae": eV per molecule, "force_mae": eV/Å
    per component, "energy_mae_per_atom": eV/atom})``. ``force_mae`` is NaN when the
    batch has no force labels.
    """
    if batch.energy is None:
        raise ValueError("batch has no energy labels")
    target_e = batch.energy.to(device=energy.device, dtype=torch.float64)
    de = energy.to(torch.float64) - target_e
    n_atoms = batch.n_atoms.to(device=energy.device, dtype=torch.float64)
    de_loss = de / n_atoms if per_atom_energy else de
    loss = (de_loss * de_loss).mean().to(torch.float32)
    metrics = {
        "energy_mae": float(de.detach().abs().mean()),
        "energy_mae_per_atom": float((de.detach() / n_atoms).abs().mean()),
        "force_mae": float("nan"),
    }
    if forces is not None and batch.forces is not None:
        df = forces.float() - batch.forces.to(device=forces.device, dtype=torch.float32)
        if force_weight > 0:
            loss = loss + force_weight * (df * df).mean()
        metrics["force_mae"] = float(df.detach().abs().mean())
    return loss, metrics
