"""ASE Calculator backed by a saved molecular surrogate (or an ensemble of them): the
molecular model or MACE, whichever ``model.kind`` the saved directory records.

>>> from convergent.models.calculator import SurrogateCalculator
>>> atoms.calc = SurrogateCalculator("runs/demo/ckpt/final")  # doctest: +SKIP
>>> atoms.get_potential_energy(), atoms.get_forces()             # doctest: +SKIP

Energy in eV, forces in eV/Å, per-atom energies in eV (``energies``). With several model
directories the results are ensemble means and ``results["energy_std"]`` (eV) and
``results["forces_std"]`` (eV/Å, per atom) hold the ensemble spread.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ase.calculators.calculator import Calculator, all_changes

from convergent.core.elements import formula
from convergent.models.batching import atoms_to_record, collate_records
from convergent.models.io import check_elements


class SurrogateCalculator(Calculator):
    """ASE calculator: energy, forces, per-atom energies (and ensemble spread)."""

    implemented_properties = ["energy", "free_energy", "forces", "energies"]

    def __init__(
        self,
        model: str | Path | torch.nn.Module | Sequence[str | Path | torch.nn.Module],
        device: str = "cpu",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        from convergent.models.io import load_model

        items = list(model) if isinstance(model, list | tuple) else [model]
        self.models: list[torch.nn.Module] = []
        for it in items:
            m = load_model(it, device)[0] if isinstance(it, str | Path) else it.to(device).eval()
            self.models.append(m)
        self.device = device

    def calculate(self, atoms: Any = None, properties: Any = None, system_changes: Any = all_changes) -> None:
        super().calculate(atoms, properties or ["energy"], system_changes)
        name = self.atoms.info.get("key") or formula(self.atoms.numbers)
        check_elements(self.models, self.atoms.numbers, f"structure {name}")
        rec = atoms_to_record(self.atoms)
        rec.pop("energy", None)
        rec.pop("forces", None)
        energies, forces, per_atom = [], [], []
        for m in self.models:
            # positions in the network's type (a float64 MACE gets float64 positions)
            dtype = getattr(m, "input_dtype", torch.float32)
            batch = collate_records([rec], dtype=dtype).to(self.device)
            if getattr(m, "force_head", None) is not None:  # direct force head
                with torch.no_grad():
                    e, ea = m(batch, per_atom=True)
                    f = m(batch, with_forces=True)[1]
            else:  # conservative forces: -dE/dpositions
                with torch.enable_grad():
                    pos = batch.positions.detach().clone().requires_grad_(True)
                    e, ea = m(batch.with_positions(pos), per_atom=True)
                    (g,) = torch.autograd.grad(e.sum(), pos)
                f = -g
            energies.append(float(e.detach()[0]))
            forces.append(f.detach().cpu().double().numpy())
            per_atom.append(ea.detach().cpu().numpy())
        e_arr, f_arr = np.asarray(energies), np.stack(forces)
        self.results["energy"] = float(e_arr.mean())
        self.results["free_energy"] = self.results["energy"]
        self.results["forces"] = f_arr.mean(0)
        self.results["energies"] = np.stack(per_atom).mean(0)
        if len(self.models) > 1:
            self.results["energy_std"] = float(e_arr.std(ddof=1))
            self.results["forces_std"] = np.linalg.norm(f_arr.std(0, ddof=1), axis=1)
