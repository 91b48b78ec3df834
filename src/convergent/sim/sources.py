"""Molecule sources: ASE's G2 and S22 collections, SMILES (RDKit ETKDGv3 + MMFF), xyz/extxyz.

:func:`load_molecules` turns ``SimulateConfig.source`` into a list of :class:`Molecule`
(positions in Å), filtered by elements and atom count. A malformed xyz/extxyz file or an
invalid SMILES raises :class:`~convergent.errors.InputError` naming the file and line, or,
with ``on_bad_input="quarantine"``, becomes an :class:`InputRejection` and is skipped.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from convergent.errors import InputError
from convergent.xyzfile import check_layout, read_frames, read_lines

# Symbols of elements 1..118 (index = atomic number).
_SYMBOLS = (
    "X H He Li Be B C N O F Ne Na Mg Al Si P S Cl Ar K Ca Sc Ti V Cr Mn Fe Co Ni Cu Zn Ga Ge "
    "As Se Br Kr Rb Sr Y Zr Nb Mo Tc Ru Rh Pd Ag Cd In Sn Sb Te I Xe Cs Ba La Ce Pr Nd Pm Sm "
    "Eu Gd Tb Dy Ho Er Tm Yb Lu Hf Ta W Re Os Ir Pt Au Hg Tl Pb Bi Po At Rn Fr Ra Ac Th Pa U "
    "Np Pu Am Cm Bk Cf Es Fm Md No Lr Rf Db Sg Bh Hs Mt Ds Rg Cn Nh Fl Mc Lv Ts Og"
).split()
_NUMBER = {s: i for i, s in enumerate(_SYMBOLS)}


@dataclass(frozen=True)
class Molecule:
    """One starting structure. ``positions`` in Å; ``molecule_id`` is stable and has no '/'."""

    molecule_id: str
    numbers: np.ndarray  # int64[N]
    positions: np.ndarray  # float64[N, 3], Å
    charge: int = 0
    multiplicity: int = 1
    origin: str = ""  # where it came from, e.g. 'g2:CH4', 'smiles.txt:12'
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def n_atoms(self) -> int:
        return int(len(self.numbers))

    @property
    def symbols(self) -> list[str]:
        return [_SYMBOLS[int(z)] for z in self.numbers]

    def to_atoms(self):  # -> ase.Atoms
        """A fresh ``ase.Atoms`` (no cell, no pbc); charge/multiplicity go to the calculator."""
        from ase import Atoms

        return Atoms(numbers=self.numbers, positions=self.positions.copy())


@dataclass(frozen=True)
class InputRejection:
    """A source entry that could not be turned into a molecule (quarantined, not fatal)."""

    where: str  # 'file:line'
    reason: str


def safe_id(text: str) -> str:
    """A molecule id usable inside record keys: no '/', no whitespace."""
    out = re.sub(r"[\s/\\]+", "_", text.strip())
    return out or "unnamed"


def _ok(mol: Molecule, elements: Sequence[str], min_atoms: int, max_atoms: int) -> bool:
    if not (min_atoms <= mol.n_atoms <= max_atoms):
        return False
    return not elements or set(mol.symbols) <= set(elements)


def filter_molecules(
    mols: Iterable[Molecule],
    elements: Sequence[str] = (),
    min_atoms: int = 1,
    max_atoms: int = 10**9,
    max_molecules: int | None = None,
) -> list[Molecule]:
    """Keep molecules made only of ``elements`` (empty: any) with an atom count in range."""
    out = [m for m in mols if _ok(m, elements, min_atoms, max_atoms)]
    return out if max_molecules is None else out[:max_molecules]


def _multiplicity_from_atoms(atoms) -> int:
    """2S+1 from ASE initial magnetic moments (sum of unpaired electrons), else parity."""
    uhf = int(round(abs(float(atoms.get_initial_magnetic_moments().sum()))))
    n_el = int(atoms.numbers.sum()) - int(round(float(atoms.get_initial_charges().sum())))
    if uhf == 0 and n_el % 2 == 1:
        uhf = 1
    return uhf + 1


def _from_ase(atoms, molecule_id: str, origin: str, info: dict | None = None) -> Molecule:
    charge = int(round(float(atoms.get_initial_charges().sum())))
    extra = dict(info or {})
    if "charge" in extra:
        charge = int(extra["charge"])
    mult = _multiplicity_from_atoms(atoms)
    for name in ("multiplicity", "mult", "spin_multiplicity"):
        if name in extra:
            mult = int(extra[name])
    return Molecule(
        molecule_id=safe_id(molecule_id),
        numbers=np.asarray(atoms.numbers, dtype=np.int64).copy(),
        positions=np.asarray(atoms.positions, dtype=np.float64).copy(),
        charge=charge,
        multiplicity=mult,
        origin=origin,
    )


def g2_molecules() -> list[Molecule]:
    """All molecules and atoms of ASE's G2 collection (ids ``g2-<name>``)."""
    from ase.collections import g2

    return [_from_ase(g2[name], f"g2-{name}", f"g2:{name}") for name in g2.names]


def s22_molecules() -> list[Molecule]:
    """The 22 dimers of ASE's S22 collection (ids ``s22-<name>``)."""
    from ase.collections import s22

    return [_from_ase(s22[name], f"s22-{name}", f"s22:{name}") for name in s22.names]


# ---------------------------------------------------------------------------- SMILES


@dataclass(frozen=True)
class SmilesEntry:
    """One SMILES with its name and where it was read (file:line)."""

    smiles: str
    name: str
    where: str


def read_smiles_file(path: str | Path) -> list[SmilesEntry]:
    """Read ``SMILES [name]`` lines; '#' comments, blank lines and a 'SMILES' header skipped."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"SMILES file not found: {p}", hint="pass an existing file")
    entries = []
    with p.open(encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            parts = text.split()
            if lineno == 1 and parts[0].lower() in ("smiles", "smi"):
                continue
            name = parts[1] if len(parts) > 1 else f"{p.stem}-{lineno}"
            entries.append(SmilesEntry(parts[0], name, f"{p}:{lineno}"))
    return entries


def nci_smiles_path() -> Path:
    """The NCI SMILES file shipped inside the RDKit wheel (``RDConfig.RDDataDir``)."""
    from rdkit import RDConfig

    return Path(RDConfig.RDDataDir) / "NCI" / "first_5K.smi"


def embed_smiles(
    smiles: str,
    seed: int = 0,
    where: str = "<smiles>",
    mmff: bool = True,
    max_iters: int = 500,
):
    """Embed one SMILES with RDKit ETKDGv3 (seeded) and relax it with MMFF94.

    Returns ``(numbers, positions Å, charge, multiplicity)``. Raises ValueError with a
    reason for an invalid SMILES or a failed embedding.
    """
    from rdkit import Chem, RDLogger
    from rdkit.Chem import AllChem, Descriptors

    RDLogger.DisableLog("rdApp.*")
    mol = Chem.MolFromSmiles(smiles)
    if mol is None:
        raise ValueError(f"invalid SMILES {smiles!r}")
    mol = Chem.AddHs(mol)
    params = AllChem.ETKDGv3()
    params.randomSeed = int(seed) & 0x7FFFFFFF
    if AllChem.EmbedMolecule(mol, params) != 0:
        params.useRandomCoords = True
        if AllChem.EmbedMolecule(mol, params) != 0:
            raise ValueError(f"RDKit ETKDGv3 could not embed {smiles!r}")
    if mmff and AllChem.MMFFHasAllMoleculeParams(mol):
        AllChem.MMFFOptimizeMolecule(mol, maxIters=max_iters)
    numbers = np.array([a.GetAtomicNum() for a in mol.GetAtoms()], dtype=np.int64)
    positions = np.asarray(mol.GetConformer().GetPositions(), dtype=np.float64)
    charge = int(Chem.GetFormalCharge(mol))
    radicals = int(Descriptors.NumRadicalElectrons(mol))
    return numbers, positions, charge, radicals + 1


def _smiles_counts(smiles: str) -> tuple[int, set[str]] | None:
    """Atom count (with hydrogens) and element set of a SMILES without embedding it."""
    from rdkit import Chem, RDLogger

    RDLogger.DisableLog("rdApp.*")
    mol = Chem.MolFromSmiles(smiles)
    if mol is None:
        return None
    mol = Chem.AddHs(mol)
    return mol.GetNumAtoms(), {a.GetSymbol() for a in mol.GetAtoms()}


def smiles_molecules(
    entries: Sequence[SmilesEntry],
    seed: int = 0,
    elements: Sequence[str] = (),
    min_atoms: int = 1,
    max_atoms: int = 10**9,
    max_molecules: int | None = None,
    on_bad_input: str = "error",
    prefix: str = "smi",
) -> tuple[list[Molecule], list[InputRejection]]:
    """Embed SMILES entries that pass the filters (checked before the costly embedding).

    An invalid SMILES raises :class:`InputError` (``file:line``) unless ``on_bad_input`` is
    ``"quarantine"``, in which case it is returned as an :class:`InputRejection`.
    """
    mols: list[Molecule] = []
    rejected: list[InputRejection] = []
    for entry in entries:
        if max_molecules is not None and len(mols) >= max_molecules:
            break
        counts = _smiles_counts(entry.smiles)
        try:
            if counts is None:
                raise ValueError(f"invalid SMILES {entry.smiles!r}")
            n, elems = counts
            if not (min_atoms <= n <= max_atoms) or (elements and not elems <= set(elements)):
                continue
            # Seed per molecule so the geometry does not depend on the rest of the file.
            mol_seed = stable_int(seed, entry.smiles)
            numbers, positions, charge, mult = embed_smiles(entry.smiles, mol_seed, entry.where)
        except ValueError as exc:
            if on_bad_input == "quarantine":
                rejected.append(InputRejection(entry.where, str(exc)))
                continue
            raise InputError(
                f"{entry.where}: {exc}",
                hint="fix or remove that line, or set simulate.on_bad_input=quarantine",
            ) from None
        mols.append(
            Molecule(
                molecule_id=safe_id(f"{prefix}-{entry.name}"),
                numbers=numbers,
                positions=positions,
                charge=charge,
                multiplicity=mult,
                origin=entry.where,
                info={"smiles": entry.smiles},
            )
        )
    return mols, rejected


# ---------------------------------------------------------------------------- xyz / extxyz


def xyz_molecules(path: str | Path, on_bad_input: str = "error") -> tuple[list[Molecule], list[InputRejection]]:
    """Read every frame of an xyz/extxyz file through ``ase.io`` (ids ``<stem>-<index>``).

    The layout is validated first so a malformed file gives ``file:line: problem``.
    """
    from ase.io import read

    p = Path(path)
    if not p.is_file():
        raise InputError(f"structure file not found: {p}", hint="pass an existing .xyz/.extxyz file")
    problems = check_layout(read_lines(p))
    rejected: list[InputRejection] = []
    if problems:
        line, what = problems[0]
        if on_bad_input != "quarantine":
            raise InputError(
                f"{p}:{line}: malformed xyz/extxyz: {what}",
                hint="fix the file, or set simulate.on_bad_input=quarantine to skip the rest",
            )
        rejected.append(InputRejection(f"{p}:{line}", f"malformed xyz/extxyz: {what}"))
        # keep the frames before the bad one
        text = p.read_text(encoding="utf-8", errors="replace").splitlines()
        good = _frames_before(text, line)
        if not good:
            return [], rejected
        import io

        frames = read(io.StringIO("\n".join(good) + "\n"), index=":", format="extxyz")
    else:
        try:  # ase's own parser: extxyz comment-line syntax etc. (located by line)
            frames = [atoms for _, atoms in read_frames(p)]
        except InputError as exc:
            if on_bad_input != "quarantine":
                raise
            return [], [InputRejection(str(p), exc.message)]
    mols = []
    for idx, atoms in enumerate(frames):
        info = dict(atoms.info)
        mols.append(_from_ase(atoms, f"{p.stem}-{idx}", f"{p}#{idx}", info))
    return mols, rejected


def _frames_before(lines: list[str], bad_line: int) -> list[str]:
    """The lines of the complete frames that end before 1-based line ``bad_line``."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        if not lines[i].strip():
            i += 1
            continue
        head = lines[i].split()
        if len(head) != 1 or not head[0].isdigit():
            break
        end = i + 2 + int(head[0])
        if end >= bad_line:  # the bad line lies inside this frame
            break
        out.extend(lines[i:end])
        i = end
    return out


# ---------------------------------------------------------------------------- dispatch


def stable_int(*parts: object) -> int:
    """A 63-bit integer hash of ``parts`` that is the same in every process and run."""
    h = hashlib.blake2b("\x1f".join(str(p) for p in parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & 0x7FFFFFFFFFFFFFFF


def check_source(source: str, on_bad_input: str = "error") -> None:
    """Fail fast on a source that cannot be read, without embedding or labelling anything:
    an unknown kind, a missing file, an invalid SMILES or a malformed xyz/extxyz file
    (``file:line``; skipped with ``on_bad_input="quarantine"``). Run before a run
    directory is created; :func:`load_molecules` does the full work later."""
    low = source.strip().lower()
    if low in ("g2", "s22", "nci"):
        return
    if low.startswith("smiles:") or low.endswith((".smi", ".smiles")):
        entries = read_smiles_file(source.split(":", 1)[1] if low.startswith("smiles:") else source)
        if on_bad_input != "quarantine":
            bad = next((e for e in entries if _smiles_counts(e.smiles) is None), None)
            if bad is not None:
                raise InputError(f"{bad.where}: invalid SMILES {bad.smiles!r}",
                                 hint="fix or remove that line, or set simulate.on_bad_input=quarantine")
    elif low.startswith(("xyz:", "extxyz:")) or low.endswith((".xyz", ".extxyz")):
        path = Path(source.split(":", 1)[1] if low.startswith(("xyz:", "extxyz:")) else source)
        if on_bad_input == "quarantine":
            read_lines(path)  # exists and readable
        else:
            read_frames(path)
    else:
        raise InputError(
            f"unknown molecule source {source!r}",
            hint="use g2, s22, nci, smiles:<file> or a path to an .xyz/.extxyz file",
        )


def load_molecules(
    source: str,
    elements: Sequence[str] = ("C", "H", "N", "O"),
    min_atoms: int = 2,
    max_atoms: int = 12,
    max_molecules: int | None = None,
    seed: int = 0,
    on_bad_input: str = "error",
) -> tuple[list[Molecule], list[InputRejection]]:
    """Resolve a source spec (see :class:`~convergent.sim.config.SimulateConfig`) to molecules.

    Raises :class:`InputError` for an unknown source, a missing file, a malformed structure
    file or an invalid SMILES (unless ``on_bad_input="quarantine"``), or when no molecule
    passes the filters.
    """
    spec = source.strip()
    low = spec.lower()
    rejected: list[InputRejection] = []
    if low == "g2":
        mols = g2_molecules()
    elif low == "s22":
        mols = s22_molecules()
    elif low == "nci" or low.startswith("smiles:") or low.endswith((".smi", ".smiles")):
        path = nci_smiles_path() if low == "nci" else Path(spec.split(":", 1)[1] if low.startswith("smiles:") else spec)
        mols, rejected = smiles_molecules(
            read_smiles_file(path),
            seed=seed,
            elements=elements,
            min_atoms=min_atoms,
            max_atoms=max_atoms,
            max_molecules=max_molecules,
            # the shipped NCI file has a few SMILES RDKit rejects; nobody can fix that file
            on_bad_input="quarantine" if low == "nci" else on_bad_input,
            prefix="nci" if low == "nci" else "smi",
        )
    elif low.startswith(("xyz:", "extxyz:")) or low.endswith((".xyz", ".extxyz")):
        path = Path(spec.split(":", 1)[1]) if low.startswith(("xyz:", "extxyz:")) else Path(spec)
        mols, rejected = xyz_molecules(path, on_bad_input=on_bad_input)
    else:
        raise InputError(
            f"unknown molecule source {source!r}",
            hint="use g2, s22, nci, smiles:<file> or a path to an .xyz/.extxyz file",
        )
    kept = filter_molecules(mols, elements, min_atoms, max_atoms, max_molecules)
    ids = [m.molecule_id for m in kept]
    if len(set(ids)) != len(ids):
        seen: dict[str, int] = {}
        renamed = []
        for m in kept:  # make ids unique deterministically (duplicate names in a SMILES file)
            k = seen.get(m.molecule_id, 0)
            seen[m.molecule_id] = k + 1
            if k:
                m = Molecule(f"{m.molecule_id}~{k}", m.numbers, m.positions, m.charge,
                             m.multiplicity, m.origin, m.info)
            renamed.append(m)
        kept = renamed
    if not kept:
        raise InputError(
            f"source {source!r}: no molecule passes the filters "
            f"(elements={list(elements)}, atoms {min_atoms}..{max_atoms})",
            hint="widen simulate.elements / simulate.max_atoms",
        )
    return kept, rejected
