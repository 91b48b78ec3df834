"""Issue 37, finding 3: `data split --by molecule` checks leakage by chemistry, not by ids.

A file whose molecule ids do not follow its chemistry (here: one id per frame, as a tool
that numbers frames writes them) split by molecule put one molecule's frames in train and
in validation while printing "leakage check passed". The split now compares chemical
identity (formula + bonded structure) and refuses such a split, before writing anything.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.cli_exe import EXE

NAMES = ["H2O", "CH4", "NH3", "CH3OH", "C2H6", "H2CO"]


def _xtb_file(path: Path, ids_per_frame: bool) -> Path:
    """36 frames of 6 G2 molecules in no order, GFN2-xTB labels (tblite)."""
    from ase.build import molecule
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.io import write

    from convergent.sim.calculators import CalcSpec, make_calculator

    frames = []
    for k in range(36):
        a = molecule(NAMES[(k * 5) % len(NAMES)])
        a.rattle(0.03, seed=k)
        a.calc = make_calculator(CalcSpec(kind="xtb"))
        e, f = float(a.get_potential_energy()), a.get_forces().copy()
        a.calc = SinglePointCalculator(a, energy=e, forces=f)
        a.info["source"] = f"traj{k % 4}"
        if ids_per_frame:
            a.info["molecule_id"] = f"frame{k}"
        frames.append(a)
    write(path, frames, format="extxyz")
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("chem")
    out = {}
    for ids in (True, False):
        f = _xtb_file(root / f"frames_{ids}.extxyz", ids_per_frame=ids)
        p = _cli("data", "pack", str(f), str(root / f"ds_{ids}"))
        assert p.returncode == 0, p.stderr
        out[ids] = root / f"ds_{ids}"
    return out


def test_a_split_whose_ids_do_not_follow_chemistry_is_refused_before_writing(packed, tmp_path):
    out = tmp_path / "split"
    p = _cli("data", "split", str(packed[True]), str(out), "--by", "molecule",
             "--splits", "train=0.6,val=0.4")
    assert p.returncode == 2, p.stdout + p.stderr
    err = [ln for ln in p.stderr.splitlines() if re.search(r"chemical identit(y|ies) in two splits", ln)]
    assert len(err) == 1 and "nothing written" in err[0], p.stderr  # one line names it
    assert "Traceback" not in p.stderr
    assert not out.exists()  # nothing half-made


def test_ids_by_chemistry_split_cleanly_and_the_report_says_what_it_checked(packed, tmp_path):
    from convergent.data.reader import open_dataset

    out = tmp_path / "split"
    p = _cli("data", "split", str(packed[False]), str(out), "--by", "molecule",
             "--splits", "train=0.6,val=0.4")
    assert p.returncode == 0, p.stderr
    rep = json.loads((out / "split.json").read_text())
    leak = rep["leakage"]
    assert leak["ok"] is True and leak["chemical_ids_in_two_splits"] == 0
    assert leak["chemical_ids_checked"] >= len(NAMES)
    formulas = {s: {r["molecule_id"].split("-")[0] for r in open_dataset(out / s)}
                for s in ("train", "val")}
    assert formulas["train"] and formulas["val"] and not formulas["train"] & formulas["val"]
