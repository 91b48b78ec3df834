"""Molecule sources: ASE's G2 and S22 collections, SMILES (RDKit ETKDGv3 + MMFF), xyz/extxyz.

The molecule type and the collections are in :mod:`convergent.sim.molecules`, SMILES in
:mod:`convergent.sim.smiles`; this module reads xyz/extxyz files and resolves a source spec.

:func:`load_molecules` turns ``SimulateConfig.source`` into a list of :class:`Molecule`
(positions in Å), filtered by elements and atom count. A malformed xyz/extxyz file or an
invalid SMILES raises :class:`~convergent.core.errors.InputError` naming the file and line, or,
with ``on_bad_input="quarantine"``, becomes an :class:`InputRejection` and is skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from convergent.core.errors import InputError
from convergent.core.xyzfile import check_layout, read_frames, read_lines
from convergent.sim.molecules import (
    InputRejection,
    Molecule,
    filter_molecules,
    from_ase,
    g2_molecules,
    s22_molecules,
)
from convergent.sim.smiles import (
    nci_smiles_path,
    read_smiles_file,
    smiles_counts,
    smiles_molecules,
)

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
        mols.append(from_ase(atoms, f"{p.stem}-{idx}", f"{p}#{idx}", info))
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


def parse_source(source: str) -> tuple[str, Path | None]:
    """``(kind, path)`` of a source spec: kind ``g2`` | ``s22`` | ``nci`` (no path) or
    ``smiles`` | ``xyz`` with the file's path; InputError for anything else."""
    spec = source.strip()
    low = spec.lower()
    if low in ("g2", "s22", "nci"):
        return low, None
    if low.startswith("smiles:") or low.endswith((".smi", ".smiles")):
        return "smiles", Path(spec.split(":", 1)[1] if low.startswith("smiles:") else spec)
    if low.startswith(("xyz:", "extxyz:")) or low.endswith((".xyz", ".extxyz")):
        return "xyz", Path(spec.split(":", 1)[1] if low.startswith(("xyz:", "extxyz:")) else spec)
    raise InputError(
        f"unknown molecule source {source!r}",
        hint="use g2, s22, nci, smiles:<file> or a path to an .xyz/.extxyz file",
    )


def check_source(source: str, on_bad_input: str = "error") -> None:
    """Fail fast on a source that cannot be read, without embedding or labelling anything:
    an unknown kind, a missing file, an invalid SMILES or a malformed xyz/extxyz file
    (``file:line``; skipped with ``on_bad_input="quarantine"``). Run before a run
    directory is created; :func:`load_molecules` does the full work later."""
    kind, path = parse_source(source)
    if kind == "smiles":
        entries = read_smiles_file(path)
        if on_bad_input != "quarantine":
            bad = next((e for e in entries if smiles_counts(e.smiles) is None), None)
            if bad is not None:
                raise InputError(f"{bad.where}: invalid SMILES {bad.smiles!r}",
                                 hint="fix or remove that line, or set simulate.on_bad_input=quarantine")
    elif kind == "xyz":
        if on_bad_input == "quarantine":
            read_lines(path)  # exists and readable
        else:
            read_frames(path)


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
    kind, path = parse_source(source)
    rejected: list[InputRejection] = []
    if kind == "g2":
        mols = g2_molecules()
    elif kind == "s22":
        mols = s22_molecules()
    elif kind in ("nci", "smiles"):
        nci = kind == "nci"
        mols, rejected = smiles_molecules(
            read_smiles_file(nci_smiles_path() if nci else path),
            seed=seed,
            elements=elements,
            min_atoms=min_atoms,
            max_atoms=max_atoms,
            max_molecules=max_molecules,
            # the shipped NCI file has a few SMILES RDKit rejects; nobody can fix that file
            on_bad_input="quarantine" if nci else on_bad_input,
            prefix="nci" if nci else "smi",
        )
    else:
        mols, rejected = xyz_molecules(path, on_bad_input=on_bad_input)
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
