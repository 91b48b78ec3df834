"""`convergent md`'s work: molecules of a source, batched MD with a committee, the
stability of every run (:func:`convergent.screen.mdcheck.stability_runs`), written as
``md.json`` and ``trajectories.extxyz`` (every kept frame, with molecule, seed and step)."""

from __future__ import annotations

from pathlib import Path

from convergent.core.errors import InputError
from convergent.core.fsutil import atomic_write_text, dumps_json
from convergent.screen.batchmd import BatchMD, MDSettings
from convergent.screen.mdcheck import MDCheck, stability_runs


def md_command(models: list[str], source: str, *, max_molecules: int | None, max_atoms: int,
               seeds: int, temperature_K: float, time_fs: float, timestep_fs: float,
               friction_per_fs: float, every: int, out: Path, device: str = "cpu") -> MDCheck:
    """Run it (see the module doc) on the source's molecules made of elements every model
    was trained on (the source filtered by them, as ``simulate.elements`` filters it)."""
    from convergent.core.elements import symbol
    from convergent.models.io import check_elements, load_model, trained_elements
    from convergent.sim.sources import load_molecules

    if device not in ("cpu", "cuda"):
        raise InputError(f"--device {device!r}: expected cpu or cuda")
    nets = [load_model(m, device)[0] for m in models]
    known = [set(e) for n in nets if (e := trained_elements(n)) is not None]
    elements = [symbol(z) for z in sorted(set.intersection(*known))] if known else []
    mols, _ = load_molecules(source, elements, 1, max_atoms, max_molecules, 0)
    for m in mols:
        check_elements(nets, m.numbers, f"molecule {m.molecule_id}")
    settings = MDSettings(temperature_K, timestep_fs, friction_per_fs, fix_com=True)
    structures = [(m.molecule_id, m.numbers, m.positions) for m in mols]
    res, md = stability_runs(nets, structures, seeds, settings, time_fs, every)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "md.json", dumps_json({
        "source": source, "models": models, "seeds": seeds, "every": every, **res.to_dict(),
        "stable_fraction": res.stable / max(1, len(res.runs))}, indent=1))
    _write_frames(out / "trajectories.extxyz", res, md)
    return res


def _write_frames(path: Path, res: MDCheck, md: BatchMD) -> None:
    """Every kept frame of every run, as extxyz (written atomically)."""
    import io

    from ase import Atoms
    from ase.io import write

    buf = io.StringIO()
    for run, t in zip(res.runs, md.traj, strict=True):
        for pos, step, e in zip(t.positions, t.steps, t.energy, strict=True):
            a = Atoms(numbers=t.numbers, positions=pos)
            a.info.update({"molecule": run.molecule, "seed": run.seed, "step": step,
                           "time_fs": step * res.timestep_fs, "energy_model": e})
            write(buf, a, format="extxyz")
    atomic_write_text(path, buf.getvalue())
