"""Forces of an ASE calculator against central differences of its energy."""

from __future__ import annotations


def fd_check(calc, atoms, h: float, tol) -> None:  # noqa: ANN001
    """Forces of ``calc`` against central differences of its energy (step ``h`` Å)."""
    atoms.calc = calc
    f = atoms.get_forces()
    for atom, axis in ((0, 0), (1, 2), (len(atoms) - 1, 1)):
        es = []
        for sign in (1, -1):
            moved = atoms.copy()
            moved.positions[atom, axis] += sign * h
            moved.calc = calc
            es.append(moved.get_potential_energy())
        fd = -(es[0] - es[1]) / (2 * h)
        assert abs(fd - f[atom, axis]) <= tol(es, f[atom, axis]), (atom, axis, fd, f[atom, axis])
