"""Calculators: GFN2-xTB via tblite (default), PySCF HF/DFT (high fidelity), EMT (tests).

Every calculator is an ASE calculator (so the MD sampler can drive it) built from a
:class:`CalcSpec`. :func:`label` runs one single point and returns energy (eV), forces
(eV/Å) and wall seconds; :meth:`CalcSpec.provenance` gives {program, version, method,
settings} to which the campaign adds wall_s and host.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from functools import cache
from importlib import metadata
from typing import Any

import numpy as np

from convergent.core.errors import ConfigError

_XTB_METHODS = {"gfn2-xtb": "GFN2-xTB", "gfn1-xtb": "GFN1-xTB", "ipea1-xtb": "IPEA1-xTB",
                "gfn2": "GFN2-xTB", "gfn1": "GFN1-xTB"}


class CalculationError(RuntimeError):
    """A calculation failed for a reason that belongs to this structure (quarantine it)."""


class SCFNotConverged(CalculationError):
    """The SCF did not converge within its iteration limit."""


class BadGeometry(CalculationError):
    """The structure is unphysical (atoms too close, non-finite coordinates)."""


@dataclass(frozen=True)
class CalcSpec:
    """What to compute and how; plain data, cheap to ship to Dask workers.

    ``kind``: ``xtb`` (tblite; ``method`` GFN2-xTB/GFN1-xTB/IPEA1-xTB), ``dft`` (PySCF;
    ``method`` ``HF`` or an xc functional such as ``B3LYP``, ``basis``, density fitting)
    or ``emt`` (ASE's effective-medium potential, for tests).
    """

    kind: str = "xtb"
    method: str = "GFN2-xTB"
    basis: str = "6-31G*"
    density_fit: bool = True
    auxbasis: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in ("xtb", "dft", "emt"):
            raise ConfigError(f"unknown calculator {self.kind!r}", hint="use xtb, dft or emt")
        if self.kind == "xtb" and self.method.lower() not in _XTB_METHODS:
            raise ConfigError(
                f"calculator xtb: unknown method {self.method!r}",
                hint="use GFN2-xTB, GFN1-xTB or IPEA1-xTB",
            )

    @classmethod
    def from_simulate(cls, sim) -> CalcSpec:
        """The calculator of a :class:`~convergent.sim.config.SimulateConfig`."""
        kind = sim.calculator
        method = sim.method or {"xtb": "GFN2-xTB", "dft": "B3LYP", "emt": "EMT"}[kind]
        if kind == "dft" and method.lower() in _XTB_METHODS:
            method = "B3LYP"
        if kind == "emt":
            method = "EMT"
        settings: dict[str, Any] = {}
        if kind == "xtb":
            method = _XTB_METHODS[method.lower()]
            settings = {
                "accuracy": sim.xtb_accuracy,
                "max_iterations": sim.xtb_max_iterations,
                "electronic_temperature": sim.xtb_electronic_temperature,
            }
        elif kind == "dft":
            settings = {"conv_tol": 1e-8, "max_cycle": 100}
        return cls(kind, method, sim.basis, sim.density_fit, None, settings)

    @classmethod
    def from_relabel(cls, rel) -> CalcSpec:
        """The high-fidelity calculator of a :class:`~convergent.sim.config.RelabelConfig`."""
        kind = rel.calculator
        method = rel.method or {"xtb": "GFN2-xTB", "dft": "B3LYP", "emt": "EMT"}[kind]
        settings: dict[str, Any] = {}
        if kind == "dft":
            settings = {"conv_tol": rel.conv_tol, "max_cycle": rel.max_cycle}
        if kind == "xtb":
            method = _XTB_METHODS.get(method.lower(), method)
        if kind == "emt":
            method = "EMT"
        return cls(kind, method, rel.basis, rel.density_fit, rel.auxbasis, settings)

    @property
    def level(self) -> str:
        """A short name of the level of theory, e.g. ``GFN2-xTB`` or ``B3LYP/6-31G*/DF``."""
        if self.kind == "dft":
            return f"{self.method}/{self.basis}" + ("/DF" if self.density_fit else "")
        return self.method

    def provenance(self) -> dict[str, Any]:
        """{program, version, method, settings} (the campaign adds wall_s and host)."""
        program = {"xtb": "tblite", "dft": "pyscf", "emt": "ase"}[self.kind]
        settings = dict(self.settings)
        if self.kind == "dft":
            settings.update(basis=self.basis, density_fit=self.density_fit,
                            auxbasis=self.auxbasis)
        return {"program": program, "version": package_version(program),
                "method": self.level, "settings": settings}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@cache
def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------------------- PySCF


def _pyscf_calculator_class():
    from ase.calculators.calculator import Calculator, all_changes
    from ase.units import Bohr, Hartree

    class PySCFCalculator(Calculator):
        """Energy (eV) and forces (eV/Å) from PySCF HF or Kohn-Sham DFT.

        Restricted for closed shells, unrestricted otherwise; ``density_fit`` uses RI
        (``auxbasis`` default: PySCF's choice for the basis). Raises
        :class:`SCFNotConverged` when the SCF does not converge.
        """

        implemented_properties = ["energy", "forces"]

        def __init__(self, method="B3LYP", basis="6-31G*", density_fit=True, auxbasis=None,
                     charge=0, multiplicity=1, conv_tol=1e-8, max_cycle=100, **kwargs):
            super().__init__(**kwargs)
            self.method = method
            self.basis = basis
            self.density_fit = density_fit
            self.auxbasis = auxbasis
            self.charge = int(charge)
            self.multiplicity = int(multiplicity)
            self.conv_tol = conv_tol
            self.max_cycle = max_cycle

        def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
            super().calculate(atoms, properties, system_changes)
            from pyscf import dft, gto, scf

            mol = gto.M(
                atom=[(int(z), tuple(p)) for z, p in zip(self.atoms.numbers, self.atoms.positions, strict=True)],
                unit="Angstrom",
                basis=self.basis,
                charge=self.charge,
                spin=self.multiplicity - 1,
                verbose=0,
            )
            closed = self.multiplicity == 1
            if self.method.upper() == "HF":
                mf = scf.RHF(mol) if closed else scf.UHF(mol)
            else:
                mf = dft.RKS(mol) if closed else dft.UKS(mol)
                mf.xc = self.method
            if self.density_fit:
                mf = mf.density_fit(auxbasis=self.auxbasis)
            mf.conv_tol = self.conv_tol
            mf.max_cycle = self.max_cycle
            energy = mf.kernel()
            if not mf.converged:
                raise SCFNotConverged(
                    f"PySCF {self.method}/{self.basis} SCF not converged in {self.max_cycle} cycles"
                )
            grad = mf.nuc_grad_method().kernel()
            self.results["energy"] = float(energy) * Hartree
            self.results["free_energy"] = self.results["energy"]
            self.results["forces"] = -np.asarray(grad) * Hartree / Bohr

    return PySCFCalculator


def make_calculator(spec: CalcSpec, charge: int = 0, multiplicity: int = 1):
    """A fresh ASE calculator for ``spec`` and the given total charge and multiplicity."""
    if spec.kind == "xtb":
        from tblite.ase import TBLite

        return TBLite(
            method=spec.method,
            charge=int(charge),
            multiplicity=int(multiplicity),
            verbosity=0,
            **spec.settings,
        )
    if spec.kind == "dft":
        try:
            import pyscf  # noqa: F401
        except ImportError:
            from convergent.core.errors import NotAvailableError

            raise NotAvailableError(
                "the dft calculator needs PySCF", hint="pip install 'convergent[dft]'"
            ) from None
        from pyscf import lib

        lib.num_threads(1)
        cls = _pyscf_calculator_class()
        return cls(method=spec.method, basis=spec.basis, density_fit=spec.density_fit,
                   auxbasis=spec.auxbasis, charge=charge, multiplicity=multiplicity,
                   **spec.settings)
    from ase.calculators.emt import EMT

    return EMT()


def check_geometry(numbers: np.ndarray, positions: np.ndarray, min_distance: float = 0.5) -> None:
    """Raise :class:`BadGeometry` for non-finite coordinates or atoms closer than ``min_distance`` Å."""
    positions = np.asarray(positions, dtype=np.float64)
    if not np.all(np.isfinite(positions)):
        raise BadGeometry("bad geometry: non-finite coordinates")
    n = len(numbers)
    if n < 2:
        return
    diff = positions[:, None, :] - positions[None, :, :]
    d2 = np.einsum("ijk,ijk->ij", diff, diff)  # squared distances: no sqrt per pair
    d2.flat[:: n + 1] = np.inf
    k = int(d2.argmin())
    if d2.flat[k] < min_distance * min_distance:
        i, j = divmod(k, n)
        raise BadGeometry(
            f"bad geometry: atoms {min(i, j)} and {max(i, j)} are {np.sqrt(d2.flat[k]):.3f} Å "
            f"apart (< {min_distance} Å)"
        )


class Labeller:
    """Worker-side helper running single points.

    A fresh calculator is built for every structure so a result never depends on the
    previous calculation (no SCF guess carried over): the same frame gives the same
    numbers in any chunking, order or retry.
    """

    def __init__(self, spec: CalcSpec, min_distance: float = 0.5) -> None:
        self.spec = spec
        self.min_distance = min_distance

    def label(self, numbers: np.ndarray, positions: np.ndarray, charge: int = 0,
              multiplicity: int = 1) -> tuple[float, np.ndarray, float]:
        """Energy (eV), forces (eV/Å, float64[N,3]) and wall seconds of one single point.

        Raises :class:`CalculationError` (bad geometry, SCF not converged, library error).
        """
        from ase import Atoms
        from ase.calculators.calculator import CalculationFailed

        check_geometry(numbers, positions, self.min_distance)
        t0 = time.perf_counter()
        atoms = Atoms(numbers=numbers, positions=positions)
        atoms.calc = make_calculator(self.spec, charge, multiplicity)
        try:
            energy = float(atoms.get_potential_energy())
            forces = np.asarray(atoms.get_forces(), dtype=np.float64).copy()
        except CalculationError:
            raise
        except CalculationFailed as exc:
            raise CalculationError(f"{self.spec.level} failed: {exc}") from None
        except (RuntimeError, ValueError, np.linalg.LinAlgError) as exc:
            raise CalculationError(f"{self.spec.level} failed: {type(exc).__name__}: {exc}") from None
        if not np.isfinite(energy) or not np.all(np.isfinite(forces)):
            raise CalculationError(f"{self.spec.level}: non-finite energy or forces")
        return energy, forces, time.perf_counter() - t0
