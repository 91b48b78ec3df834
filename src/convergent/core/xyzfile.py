"""xyz / extxyz structure files read with ``file:line`` in every error.

ASE parses the files; before it does, :func:`check_layout` walks the frame layout line by
line (an integer atom count, a comment line, then that many atom lines with an element
and three finite coordinates, in the columns an extxyz ``Properties=`` entry names), so a
malformed file is reported as ``FILE:LINE: malformed xyz/extxyz: <problem>``. A comment
line ASE rejects (bad ``key=value`` syntax, a ``Properties`` that disagrees with the atom
lines) is located by parsing frame by frame. Used by ``simulate`` (sources),
``data pack`` and ``screen``.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

from convergent.core.errors import InputError

XYZ_SUFFIXES = (".xyz", ".extxyz")


def is_xyz(path: str | Path) -> bool:
    """True for a ``.xyz``/``.extxyz`` file name (case-insensitive)."""
    return str(path).lower().endswith(XYZ_SUFFIXES)


def _columns(comment: str) -> tuple[int, int, int]:
    """(species column, first position column, minimum columns) from an extxyz comment.

    Plain xyz (or no ``Properties=``): species in column 0, positions in 1..3.
    """
    m = re.search(r"Properties=([^\s]+)", comment, flags=re.IGNORECASE)
    if not m:
        return 0, 1, 4
    fields = m.group(1).strip("\"'").split(":")
    species = pos = None
    col = 0
    for i in range(0, len(fields) - 2, 3):
        name, count = fields[i].lower(), fields[i + 2]
        n = int(count) if count.isdigit() else 1
        if name in ("species", "z") and species is None:
            species = col
        elif name in ("pos", "positions") and pos is None:
            pos = col
        col += n
    if species is None or pos is None:
        return 0, 1, 4
    return species, pos, max(species + 1, pos + 3)


def _element_ok(sym: str) -> bool:
    from ase.data import atomic_numbers, chemical_symbols

    return sym in atomic_numbers or (sym.isdigit() and 0 < int(sym) < len(chemical_symbols))


def _finite(values: list[float]) -> bool:
    return all(v == v and abs(v) != float("inf") for v in values)


def check_layout(lines: list[str]) -> list[tuple[int, str]]:
    """Problems ``(1-based line, what)`` in the frame layout (empty if it is sound).

    Stops at the first problem: after it the layout of the rest is unknown.
    """
    i, n_lines = 0, len(lines)
    while i < n_lines:
        if not lines[i].strip():
            i += 1
            continue
        head = lines[i].split()
        if len(head) != 1 or not head[0].isdigit():
            return [(i + 1, f"expected an atom count, got {lines[i].strip()[:40]!r}")]
        n, start = int(head[0]), i
        if start + 1 >= n_lines:
            return [(start + 1, f"frame of {n} atoms has no comment line")]
        sp_col, pos_col, min_cols = _columns(lines[start + 1])
        for k in range(n):
            ln = start + 2 + k
            if ln >= n_lines:
                return [(ln + 1, f"frame starting at line {start + 1} declares {n} "
                         f"atoms but the file ends after {k}")]
            cols = lines[ln].split()
            if len(cols) < min_cols:
                return [(ln + 1, f"atom line needs 'symbol x y z', got {lines[ln].strip()[:40]!r}")]
            if not _element_ok(cols[sp_col]):
                return [(ln + 1, f"unknown element {cols[sp_col]!r}")]
            try:
                xyz = [float(c) for c in cols[pos_col:pos_col + 3]]
            except ValueError:
                return [(ln + 1, "coordinates are not numbers: "
                         f"{' '.join(cols[pos_col:pos_col + 3])!r}")]
            if not _finite(xyz):
                return [(ln + 1, "non-finite coordinate")]
        i = start + 2 + n
    return []


def frame_starts(lines: list[str]) -> list[int]:
    """0-based line index of each frame's atom-count line (layout assumed sound)."""
    out, i = [], 0
    while i < len(lines):
        if not lines[i].strip():
            i += 1
            continue
        out.append(i)
        i += 2 + int(lines[i].split()[0])
    return out


def read_lines(path: str | Path) -> list[str]:
    """The lines of a structure file; InputError naming it if it cannot be read."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"structure file not found: {p}", hint="pass an existing .xyz/.extxyz file")
    try:
        return p.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        raise InputError(f"{p}: cannot read: {exc.strerror or exc}") from None


def read_frames(path: str | Path) -> list[tuple[int, Any]]:
    """``[(line, ase.Atoms), ...]`` for every frame (``line``: 1-based line of its atom count).

    Raises :class:`InputError` ``FILE:LINE: malformed xyz/extxyz: ...`` for a malformed
    file and ``FILE: no structures`` for an empty one.
    """
    import ase.io

    p = Path(path)
    lines = read_lines(p)
    problems = check_layout(lines)
    if problems:
        line, what = problems[0]
        raise InputError(f"{p}:{line}: malformed xyz/extxyz: {what}",
                         hint="fix the file at that line (atom count, comment, 'symbol x y z')")
    starts = frame_starts(lines)
    if not starts:
        raise InputError(f"{p}: no structures in the file", hint="an xyz frame is: atom count, comment, atom lines")
    try:
        frames = ase.io.read(io.StringIO("\n".join(lines) + "\n"), index=":", format="extxyz")
    except Exception:  # noqa: BLE001 - ASE raises many types; locate the frame below
        frames = None
    if frames is None or len(frames) != len(starts):
        for s in starts:
            n = int(lines[s].split()[0])
            try:
                ase.io.read(io.StringIO("\n".join(lines[s:s + 2 + n]) + "\n"), format="extxyz")
            except Exception as exc:  # noqa: BLE001
                raise InputError(
                    f"{p}:{s + 2}: malformed extxyz comment line: {' '.join(str(exc).split())}",
                    hint="check its key=value pairs and that Properties= matches the atom lines",
                ) from None
        raise InputError(f"{p}: ASE read {0 if frames is None else len(frames)} frames, "
                         f"the layout has {len(starts)}")
    return [(s + 1, a) for s, a in zip(starts, frames, strict=True)]
