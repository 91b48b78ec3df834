"""The energy + force loss of the molecular surrogate (eV, eV/Å), written once.

::

    loss = mean_molecules((ΔE / n_atoms)²) + force_weight · mean_components(ΔF²)

Everything is built from *sums* over a batch (:func:`error_sums`): the training loop
divides them by the global molecule/atom counts of a step so that ranks' shares add up
to the global-batch loss (:func:`loss_from_sums`), metrics come from sums added over
batches and ranks (:func:`metrics_from_sums`), and :func:`energy_force_loss` is the
plain one-batch form used by the active-learning trainer, the tests and the benches.
"""

from __future__ import annotations

import torch

from convergent.models.batching import AtomsBatch

# the sum statistics of :func:`error_sums`, in a fixed order (for cross-rank reductions)
SUM_KEYS = ("e_sq", "f_sq", "e_abs", "e_abs_pa", "f_abs", "molecules", "atoms")


def error_sums(
    energy: torch.Tensor, forces: torch.Tensor | None, batch: AtomsBatch
) -> dict[str, torch.Tensor]:
    """Sum statistics of predicted ``energy`` float[B] eV and ``forces`` float[N,3] eV/Å
    against the labels of ``batch`` (0-d tensors; ``e_sq`` and ``f_sq`` keep the graph):

    ``e_sq`` Σ(ΔE/n)², ``e_abs`` Σ|ΔE|, ``e_abs_pa`` Σ|ΔE/n| (float64, over molecules);
    ``f_sq`` ΣΔF², ``f_abs`` Σ|ΔF| (over force components; 0 when the batch has no force
    labels); ``molecules`` and ``atoms`` the counts.
    """
    if batch.energy is None:
        raise ValueError("batch has no energy labels")
    dev = energy.device
    de = energy.to(torch.float64) - batch.energy.to(device=dev, dtype=torch.float64)
    de_pa = de / batch.n_atoms.to(device=dev, dtype=torch.float64)
    sums = {
        "e_sq": (de_pa * de_pa).sum(),
        "e_abs": de.detach().abs().sum(),
        "e_abs_pa": de_pa.detach().abs().sum(),
        "molecules": torch.tensor(float(batch.n_molecules)),
        "atoms": torch.tensor(float(batch.num_atoms)),
    }
    if forces is not None and batch.forces is not None:
        df = forces.float() - batch.forces.to(device=forces.device, dtype=torch.float32)
        sums["f_sq"] = (df * df).sum()
        sums["f_abs"] = df.detach().abs().sum().double()
    else:
        sums["f_sq"] = torch.zeros((), dtype=torch.float64, device=dev)
        sums["f_abs"] = torch.zeros((), dtype=torch.float64, device=dev)
    return sums


def loss_from_sums(
    sums: dict[str, torch.Tensor], molecules: float, atoms: float, force_weight: float,
    scale: float = 1.0,
) -> torch.Tensor:
    """The loss of :func:`error_sums` over ``molecules`` molecules and ``atoms`` atoms
    (a step's global counts, or the batch's own), times ``scale``; float32."""
    loss = sums["e_sq"] / molecules
    if force_weight > 0:
        loss = loss + force_weight * sums["f_sq"].double() / (3.0 * atoms)
    return (loss * scale).to(torch.float32)


def metrics_from_sums(sums: dict[str, float], force_weight: float) -> dict[str, float]:
    """Loss and MAEs from sum statistics added over batches (and ranks): ``loss``,
    ``energy_mae`` (eV per molecule), ``energy_mae_per_atom`` (eV/atom), ``force_mae``
    (eV/Å per component)."""
    mol = max(sums.get("molecules", 0.0), 1.0)
    comps = max(3.0 * sums.get("atoms", 0.0), 1.0)
    e_term = sums.get("e_sq", 0.0) / mol
    f_term = sums.get("f_sq", 0.0) / comps
    out = {
        "loss": e_term + force_weight * f_term,
        "energy_mae": sums.get("e_abs", 0.0) / mol,
        "energy_mae_per_atom": sums.get("e_abs_pa", 0.0) / mol,
        "force_mae": sums.get("f_abs", 0.0) / comps,
    }
    if sums.get("b_n", 0.0) > 0:  # validation: the per-element baseline (baseline_sums)
        out["baseline_energy_mae"] = sums["b_abs"] / sums["b_n"]
    return out


BASELINE_KEYS = ("b_abs", "b_n")


def baseline_sums(model: torch.nn.Module, batch: AtomsBatch) -> dict[str, torch.Tensor]:
    """``b_abs`` Σ|Σ_atoms ref[Z] - E| over the batch's molecules and ``b_n`` their count:
    the per-element baseline's error, with the model's element reference energies (its
    least-squares fit on the training data). Empty when the model has none or the batch
    has no energy labels."""
    ref = getattr(getattr(model, "module", model), "atomref", None)
    if not isinstance(ref, torch.Tensor) or batch.energy is None or not bool((ref != 0).any()):
        return {}
    dev = batch.energy.device
    per_atom = ref.to(device=dev, dtype=torch.float64)[batch.numbers.to(dev)]
    base = torch.zeros(batch.n_molecules, dtype=torch.float64, device=dev)
    base.index_add_(0, batch.batch.to(dev), per_atom)
    return {"b_abs": (base - batch.energy.to(torch.float64)).abs().sum(),
            "b_n": torch.tensor(float(batch.n_molecules), dtype=torch.float64)}


def energy_force_loss(
    energy: torch.Tensor,
    forces: torch.Tensor | None,
    batch: AtomsBatch,
    force_weight: float = 10.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted MSE loss and MAE metrics of one batch (see the module doc).

    ``forces`` None (or ``force_weight=0``) trains on energies only. Returns ``(loss
    fp32 scalar, {"energy_mae": eV per molecule, "force_mae": eV/Å per component,
    "energy_mae_per_atom": eV/atom})``; ``force_mae`` is NaN when the batch has no force
    labels or no forces are given.
    """
    sums = error_sums(energy, forces, batch)
    loss = loss_from_sums(sums, batch.n_molecules, batch.num_atoms, force_weight)
    metrics = metrics_from_sums({k: float(v.detach()) if torch.is_tensor(v) else float(v) for k, v in sums.items()}, force_weight)
    del metrics["loss"]
    if forces is None or batch.forces is None:
        metrics["force_mae"] = float("nan")
    return loss, metrics
