"""A small labelled molecular dataset for training tests (ASE EMT: fast, deterministic)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

NAMES = ["H2O", "CH4", "NH3", "C2H6", "CH3OH", "C2H4", "HCN", "CO2", "H2CO", "C2H2", "N2", "CH3CN"]


def make_dataset(root: Path, n_train: int = 96, n_val: int = 24, seed: int = 0) -> tuple[Path, Path]:
    """Write ``root/train`` and ``root/val`` (different molecules) and return both paths."""
    from ase.build import molecule
    from ase.calculators.emt import EMT

    from convergent.data.writer import write_records

    rng = np.random.default_rng(seed)
    train_names, val_names = NAMES[:9], NAMES[9:]

    def records(names: list[str], n: int, tag: str):
        out = []
        for i in range(n):
            name = names[i % len(names)]
            atoms = molecule(name)
            atoms.positions += rng.normal(0.0, 0.08, atoms.positions.shape)
            atoms.calc = EMT()
            out.append(
                {
                    "key": f"{tag}{i}",
                    "molecule_id": name,
                    "numbers": atoms.numbers.astype(np.int64),
                    "positions": atoms.positions.astype(np.float64),
                    "energy": float(atoms.get_potential_energy()),
                    "forces": atoms.get_forces().astype(np.float64),
                }
            )
        return out

    train, val = root / "train", root / "val"
    write_records(train, records(train_names, n_train, "t"), compression="none")
    write_records(val, records(val_names, n_val, "v"), compression="none")
    return train, val
