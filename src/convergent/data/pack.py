"""``data pack DIR``: turn a tree of many small files into a few checksummed shards.

Any files become ``bytes`` records (key = path relative to DIR, payload = contents);
``.xyz``/``.extxyz`` files become ``molecular`` records (one per frame; energy and forces
from the extxyz properties or an attached calculator). ``schema="auto"`` picks molecular
when every file is xyz/extxyz. ``DIR`` may also be a single file.

Molecule ids (what the by-molecule split keeps on one side): a frame's own
``molecule_id`` (an extxyz comment key) wins; otherwise its chemical identity
(:func:`convergent.data.identity.chemical_id`: the formula and the canonical SMILES of its
bonded structure), so every frame of one molecule gets one id wherever it sits in the file
or the tree, and frames of different molecules never share one. A frame without a
chemical id (periodic, or atoms RDKit cannot bond) falls back to the file's path relative
to DIR without its suffix, plus ``-<k>`` when the file holds several molecules (``k``
numbers the runs of consecutive frames with the same atoms in the same order). A frame's
own ``source`` is kept; where it came from is in ``meta.file`` (``FILE:LINE``).

A malformed xyz/extxyz file is reported as ``FILE:LINE: ...``; a failed pack removes its
shards and, if it created the output directory, the directory too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from convergent.core.errors import DataError, InputError
from convergent.core.xyzfile import is_xyz, read_frames
from convergent.data.identity import chemical_id
from convergent.data.manifest import Manifest


def list_files(root: str | os.PathLike[str]) -> list[str]:
    """Relative paths of all regular files under ``root`` (sorted, hidden files skipped)."""
    base = Path(root)
    if not base.is_dir():
        raise InputError(f"not a directory: {base}", hint="pass the directory holding the small files")
    out: list[str] = []
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(base / rel if rel else base) as it:
            for e in it:
                if e.name.startswith("."):
                    continue
                r = f"{rel}/{e.name}" if rel else e.name
                if e.is_dir(follow_symlinks=False):
                    stack.append(r)
                elif e.is_file():
                    out.append(r)
    out.sort()
    return out


def frame_molecule_ids(base: str, frames: list[Any]) -> list[str]:
    """Molecule id of each frame (rule in the module docstring): ``molecule_id`` from
    the frame's info, else its chemical id, else ``base`` (one molecule) or ``base-<k>``
    (run ``k`` of consecutive frames with identical atomic numbers)."""
    runs: list[int] = []
    for i, atoms in enumerate(frames):
        same = i > 0 and np.array_equal(atoms.numbers, frames[i - 1].numbers)
        runs.append(runs[-1] if same else (runs[-1] + 1 if runs else 0))
    several = bool(runs) and runs[-1] > 0
    out = []
    for a, k in zip(frames, runs, strict=True):
        chem = None if "molecule_id" in a.info else chemical_id(
            a.numbers, a.positions, periodic=bool(np.any(a.pbc)))
        out.append(str(a.info["molecule_id"]) if "molecule_id" in a.info else chem
                   or (f"{base}-{k}" if several else base))
    return out


def xyz_records(root: Path, rel: str) -> Iterator[dict[str, Any]]:
    """Molecular records of every frame of an xyz/extxyz file (InputError ``FILE:LINE``)."""
    located = read_frames(root / rel)
    frames = [a for _, a in located]
    base = rel[: -len(Path(rel).suffix)] if Path(rel).suffix else rel
    ids = frame_molecule_ids(base, frames)
    for i, ((line, atoms), mol_id) in enumerate(zip(located, ids, strict=True)):
        energy, forces = atoms.info.get("energy"), atoms.arrays.get("forces")
        if atoms.calc is not None:
            res = getattr(atoms.calc, "results", {})
            energy = res.get("energy", energy)
            forces = res.get("forces", forces)
        cell = np.asarray(atoms.cell.array, np.float64)
        meta = {k: v for k, v in atoms.info.items() if isinstance(v, (str, int, float, bool))}
        meta["file"] = f"{rel}:{line}"
        meta.setdefault("source", meta["file"])  # the frame's own source is kept
        yield {
            "key": rel if len(frames) == 1 else f"{rel}#{i}",
            "molecule_id": mol_id,
            "numbers": atoms.numbers, "positions": atoms.positions,
            "energy": float(energy) if energy is not None else None,
            "forces": None if forces is None else np.asarray(forces, np.float64),
            "cell": cell, "pbc": atoms.pbc,
            "charge": int(atoms.info.get("charge", 0)),
            "multiplicity": int(atoms.info.get("multiplicity", 1)),
            "meta": meta,
        }


def _records(root: Path, files: list[str], schema: str, tick: Callable[[], None]) -> Iterator[dict[str, Any]]:
    for rel in files:
        if schema == "molecular":
            yield from xyz_records(root, rel)
        else:
            yield {"key": rel, "payload": (root / rel).read_bytes()}
        tick()


def pack_directory(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    schema: str = "auto",
    shard_bytes: int = 128 * 2**20,
    compression: str = "zstd",
    overwrite: bool = False,
    progress: bool = False,
    workers: int = 0,
    client: Any = None,
) -> Manifest:
    """Pack every file under ``src`` into a dataset at ``out``.

    Args:
        schema: ``"auto"``, ``"bytes"`` or ``"molecular"``.
        progress: show a rich progress bar (files done / total).
        workers: > 0 packs in that many parallel parts on Dask (one writer per part,
            then an index merge); ``client`` selects a cluster.
    """
    given = Path(src)
    if given.is_file():  # one file: pack it alone (its name is the key)
        root, files = given.parent, [given.name]
        if Path(out).resolve() == given.resolve():
            raise InputError(f"output {out} is the input file", hint="name another dataset directory")
    else:
        root = given
        files = list_files(root)
        if not files:
            raise InputError(f"{root}: no files to pack")
        if Path(out).resolve() == root.resolve() or Path(out).resolve().is_relative_to(root.resolve()):
            raise InputError(f"output {out} is inside the input directory {root}",
                             hint="write the dataset somewhere else")
    if schema == "auto":
        schema = "molecular" if all(is_xyz(f) for f in files) else "bytes"
    if schema == "molecular":
        bad = [f for f in files if not is_xyz(f)]
        if bad:
            raise InputError(f"{root / bad[0]}: not an xyz/extxyz file but schema is molecular",
                             hint="use --schema bytes to pack arbitrary files")
    elif schema != "bytes":
        raise DataError(f"unknown schema {schema!r}", hint="use auto, bytes or molecular")
    created = not Path(out).exists()
    try:
        return _pack(root, files, Path(out), schema, shard_bytes, compression, overwrite,
                     progress, workers, client)
    except BaseException:
        if created:  # the writers removed their shards; leave no empty directory behind
            with contextlib.suppress(OSError):
                shutil.rmtree(out)
        raise


def _pack(root: Path, files: list[str], out: Path, schema: str, shard_bytes: int,
          compression: str, overwrite: bool, progress: bool, workers: int,
          client: Any) -> Manifest:
    if workers > 0:
        from convergent.data.parallel import write_parallel

        chunk = -(-len(files) // workers)
        parts = [
            _PartFn(str(root), files[i : i + chunk], schema) for i in range(0, len(files), chunk)
        ]
        return write_parallel(parts, out, schema=schema, shard_bytes=shard_bytes,
                              compression=compression, overwrite=overwrite, client=client)
    from convergent.data.writer import DatasetWriter

    if progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        bar = Progress("[progress.description]{task.description}", BarColumn(),
                       MofNCompleteColumn(), TimeRemainingColumn())
    else:
        bar = None
    with DatasetWriter(out, schema=schema, shard_bytes=shard_bytes, compression=compression,
                       overwrite=overwrite, commit_on_error=False) as w:
        if bar is not None:
            with bar:
                task = bar.add_task(f"packing {root}", total=len(files))
                w.write_many(_records(root, files, schema, lambda: bar.advance(task)))
        else:
            w.write_many(_records(root, files, schema, lambda: None))
    return w.manifest


class _PartFn:
    """Picklable zero-arg callable producing one part's records on a Dask worker."""

    def __init__(self, root: str, files: list[str], schema: str) -> None:
        self.root, self.files, self.schema = root, files, schema

    def __call__(self) -> Iterator[dict[str, Any]]:
        return _records(Path(self.root), self.files, self.schema, lambda: None)
