"""MACE (the ``mace-torch`` package) as a peer of the molecular benchmarks.

:class:`MacePotential` wraps MACE's own model class (``mace.modules.ScaleShiftMACE``, what
``mace_run_train --model MACE`` builds) behind the same ``parameters / train / predict``
interface as ``OurPotential`` and ``SpkPotential`` in molbench.py, so the bench trains it
with the same loop (``molbench.train_for``), loss, references and budget as every other side.

The model's input dict is built here from our :class:`~convergent.models.batching.AtomsBatch`
(MACE's keys: ``positions``, ``node_attrs`` one-hot over the element table, ``edge_index``
sender/receiver, ``shifts``, ``batch``, ``ptr``, ``cell``), with neighbours from
``convergent.models.atoms.neighbor_list`` like the schnetpack peers, rather than through
``mace.data.AtomicData`` + its loader: the batches of ``train_for`` are already collated, and
every side then sees the same neighbour lists. Energies and forces (``-dE/dx`` by autograd)
are MACE's own outputs. Optional: needs ``pip install -e '.[mace]'``.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

# MACE's settings for the bench (its mace_run_train defaults unless noted)
MACE_DEFAULTS: dict[str, Any] = {
    "model_class": "mace.modules.ScaleShiftMACE (as mace_run_train --model MACE)",
    "num_bessel": 8,
    "num_polynomial_cutoff": 5,
    "max_ell": 3,
    "correlation": 3,
    "num_interactions": 2,
    "hidden_irreps": "32x0e+32x1o",  # smaller than its 128x0e+128x1o default: a CPU budget
    "MLP_irreps": "16x0e",
    "radial_MLP": [64, 64, 64],
    "gate": "silu",
    "interaction_cls_first": "RealAgnosticInteractionBlock",
    "interaction_cls": "RealAgnosticResidualInteractionBlock",
    "radial_type": "bessel",
    "atomic_energies": "our element references fitted on the fold's training set (E0s)",
    "atomic_inter_scale": "RMS force of the training set (MACE's rms_forces_scaling; "
                          "the same scale the other sides get)",
    "atomic_inter_shift": 0.0,
    "avg_num_neighbors": "mean neighbours per atom within r_max over the training set",
}


def mace_import() -> Any:
    """Import ``mace.modules`` quietly, undoing its import-time side effects (the one
    definition: :func:`convergent.models.mace.import_mace`, which ``model.kind: mace``
    uses too). :class:`~convergent.core.errors.NotAvailableError` if mace-torch is missing."""
    from convergent.models.mace import import_mace

    return import_mace()[0]


def mace_available() -> tuple[bool, str]:
    """(True, version) when mace-torch imports, else (False, the reason)."""
    try:
        mace_import()
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to skip the side
        return False, f"mace-torch not importable: {type(exc).__name__}: {exc}"
    from importlib import metadata

    return True, metadata.version("mace-torch")


def avg_num_neighbors(records: list[dict[str, Any]], cutoff: float, batch_atoms: int = 4096) -> float:
    """Mean number of neighbours within ``cutoff`` per atom over ``records`` (the one
    definition: :func:`convergent.models.mace.avg_num_neighbors`)."""
    from convergent.models import mace

    return mace.avg_num_neighbors(records, cutoff, batch_atoms)


class MacePotential:
    """A MACE model (mace-torch's ``ScaleShiftMACE``) behind the bench's potential interface.

    ``ref`` is the fold's :class:`~convergent.models.molecular.ReferenceEnergies` (its
    per-element energies become MACE's E0s, its RMS-force scale MACE's interaction scale);
    ``train_records`` give ``avg_num_neighbors``. ``dtype`` float32 (default) or float64
    (what MACE recommends for MD and accuracy); ``overrides`` replace entries of
    :data:`MACE_DEFAULTS` (e.g. ``hidden_irreps``).
    """

    name = "mace"

    def __init__(self, cutoff: float, ref: Any, train_records: list[dict[str, Any]],
                 dtype: Any = None, **overrides: Any) -> None:
        import torch

        modules = mace_import()  # first: it imports e3nn (see mace_import)
        from e3nn import o3

        unknown = set(overrides) - set(MACE_DEFAULTS)
        if unknown:
            raise ValueError(f"MACE: unknown setting(s) {sorted(unknown)}; known: {sorted(MACE_DEFAULTS)}")
        self.cutoff = float(cutoff)
        self.dtype = dtype or torch.float32
        s = {**MACE_DEFAULTS, **overrides}
        self.zs = sorted(int(z) for z in ref.energies)
        self.avg_neighbors = avg_num_neighbors(train_records, cutoff)
        self.settings = {**s, "r_max": self.cutoff, "elements": self.zs,
                         "avg_num_neighbors": self.avg_neighbors,
                         "atomic_inter_scale": float(ref.scale),
                         "atomic_inter_shift": float(ref.shift),
                         "dtype": str(self.dtype).removeprefix("torch.")}
        with warnings.catch_warnings():  # e3nn compiles its kernels with torch.jit.script,
            warnings.simplefilter("ignore", DeprecationWarning)  # deprecated in torch 2.13
            warnings.filterwarnings("ignore", "The TorchScript type system", UserWarning)
            self.net = self._build(modules, o3, s, ref).to(self.dtype)
        index = torch.full((119,), -1, dtype=torch.long)
        index[torch.tensor(self.zs)] = torch.arange(len(self.zs))
        self._index = index

    def _build(self, modules: Any, o3: Any, s: dict[str, Any], ref: Any) -> Any:
        return modules.ScaleShiftMACE(
            r_max=self.cutoff, num_bessel=s["num_bessel"],
            num_polynomial_cutoff=s["num_polynomial_cutoff"], max_ell=s["max_ell"],
            interaction_cls=modules.interaction_classes[s["interaction_cls"]],
            interaction_cls_first=modules.interaction_classes[s["interaction_cls_first"]],
            num_interactions=s["num_interactions"], num_elements=len(self.zs),
            hidden_irreps=o3.Irreps(s["hidden_irreps"]), MLP_irreps=o3.Irreps(s["MLP_irreps"]),
            atomic_energies=np.asarray([ref.energies[z] for z in self.zs], dtype=np.float64),
            avg_num_neighbors=self.avg_neighbors, atomic_numbers=self.zs,
            correlation=s["correlation"], gate=modules.gate_dict[s["gate"]],
            radial_MLP=list(s["radial_MLP"]), radial_type=s["radial_type"],
            atomic_inter_scale=float(ref.scale), atomic_inter_shift=float(ref.shift),
        )

    def parameters(self) -> Any:
        return list(self.net.parameters())

    def train(self, flag: bool = True) -> None:
        self.net.train(flag)

    def inputs(self, batch: Any) -> dict[str, Any]:
        """MACE's input dict for one of our batches (positions in the model's dtype)."""
        import torch

        from convergent.models.atoms import neighbor_list

        idx = self._index[batch.numbers]
        if bool((idx < 0).any()):
            missing = sorted(set(batch.numbers[idx < 0].tolist()))
            raise ValueError(f"MACE: element(s) {missing} not in the training set's elements {self.zs}")
        pos = batch.positions.detach().to(self.dtype).clone()
        nl = neighbor_list(pos, self.cutoff, batch.batch, batch.n_molecules)
        ptr = torch.zeros(batch.n_molecules + 1, dtype=torch.long)
        ptr[1:] = torch.cumsum(batch.n_atoms, 0)
        return {
            "positions": pos,
            "node_attrs": torch.nn.functional.one_hot(idx, len(self.zs)).to(self.dtype),
            "edge_index": nl.edge_index,  # (sender, receiver): MACE's vector is r_recv - r_send
            "shifts": nl.shifts.to(self.dtype),
            "unit_shifts": nl.cell_shifts.to(self.dtype),
            "batch": batch.batch,
            "ptr": ptr,
            "cell": torch.zeros(batch.n_molecules, 3, 3, dtype=self.dtype),
        }

    def predict(self, batch: Any, training: bool) -> tuple[Any, Any]:
        import torch

        with torch.enable_grad():
            out = self.net(self.inputs(batch), training=training, compute_force=True)
        energy, forces = out["energy"].double(), out["forces"]
        if not training:
            return energy.detach(), forces.detach()
        return energy, forces
