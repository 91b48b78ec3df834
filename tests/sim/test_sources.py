"""Molecule sources: G2/S22 collections, SMILES embedding, xyz/extxyz, filters, errors."""

from __future__ import annotations

import numpy as np
import pytest

from convergent.core.errors import InputError
from convergent.sim.smiles import (
    embed_smiles,
    nci_smiles_path,
    read_smiles_file,
    smiles_molecules,
)
from convergent.sim.sources import load_molecules, xyz_molecules


def test_g2_filtered_by_elements_and_atom_count():
    mols, rejected = load_molecules("g2", ["C", "H", "N", "O"], 2, 6)
    assert rejected == []
    assert len(mols) > 20
    for m in mols:
        assert set(m.symbols) <= {"C", "H", "N", "O"}
        assert 2 <= m.n_atoms <= 6
        assert m.positions.shape == (m.n_atoms, 3)
        assert "/" not in m.molecule_id
    ids = {m.molecule_id for m in mols}
    assert "g2-H2O" in ids and "g2-CH4" in ids
    assert "g2-SiH4" not in ids  # Si filtered out
    assert len(ids) == len(mols)
    # radicals get their multiplicity from ASE's magnetic moments
    by_id = {m.molecule_id: m for m in mols}
    assert by_id["g2-OH"].multiplicity == 2
    assert by_id["g2-H2O"].multiplicity == 1


def test_s22_dimers():
    mols, _ = load_molecules("s22", [], 2, 100)
    assert len(mols) == 22
    assert all(m.molecule_id.startswith("s22-") for m in mols)


def test_smiles_embedding_is_seeded_and_relaxed():
    n1, p1, q, mult = embed_smiles("CCO", seed=7)
    n2, p2, _, _ = embed_smiles("CCO", seed=7)
    assert q == 0 and mult == 1
    assert list(n1) == list(n2) and len(n1) == 9  # ethanol with hydrogens
    np.testing.assert_array_equal(p1, p2)
    d = np.linalg.norm(p1[:, None] - p1[None], axis=-1)[np.triu_indices(9, 1)]
    assert d.min() > 0.9  # a sensible geometry (MMFF relaxed), no clashes
    _, p3, _, _ = embed_smiles("CCO", seed=8)
    assert not np.allclose(p1, p3)


def test_smiles_file_filters_before_embedding(tmp_path):
    f = tmp_path / "mols.smi"
    f.write_text("SMILES Name\nC methane\nCCO ethanol\nClCCl dcm\nc1ccccc1CCCCCC hexylbenzene\n")
    mols, rejected = load_molecules(f"smiles:{f}", ["C", "H", "O"], 2, 12)
    assert [m.molecule_id for m in mols] == ["smi-methane", "smi-ethanol"]
    assert rejected == []
    assert mols[1].info["smiles"] == "CCO"


def test_invalid_smiles_names_file_and_line(tmp_path):
    f = tmp_path / "bad.smi"
    f.write_text("CCO ok\n\nC1CC( broken\nCC fine\n")
    with pytest.raises(InputError) as err:
        load_molecules(f"smiles:{f}", ["C", "H", "O"], 2, 12)
    assert f"{f}:3" in err.value.message
    assert "invalid SMILES" in err.value.message
    mols, rejected = load_molecules(f"smiles:{f}", ["C", "H", "O"], 2, 12,
                                    on_bad_input="quarantine")
    assert [m.molecule_id for m in mols] == ["smi-ok", "smi-fine"]
    assert len(rejected) == 1 and rejected[0].where == f"{f}:3"


def test_nci_file_from_the_rdkit_wheel():
    path = nci_smiles_path()
    assert path.is_file()
    entries = read_smiles_file(path)
    assert len(entries) > 1000
    mols, _ = smiles_molecules(entries, seed=0, elements=["C", "H", "N", "O"], max_atoms=16,
                               max_molecules=3, prefix="nci")
    assert len(mols) == 3
    assert all(m.molecule_id.startswith("nci-") and m.n_atoms <= 16 for m in mols)
    # the source spec: SMILES that RDKit rejects in the shipped file are quarantined
    mols, rejected = load_molecules("nci", ["C", "H", "N", "O"], 2, 12, max_molecules=4)
    assert len(mols) == 4 and all(m.n_atoms <= 12 for m in mols)


def test_extxyz_roundtrip_with_info(tmp_path):
    from ase.build import molecule
    from ase.io import write

    a, b = molecule("H2O"), molecule("NH3")
    b.info["charge"] = 0
    f = tmp_path / "two.extxyz"
    write(f, [a, b], format="extxyz")
    mols, rejected = load_molecules(str(f), [], 1, 50)
    assert rejected == []
    assert [m.molecule_id for m in mols] == ["two-0", "two-1"]
    np.testing.assert_allclose(mols[1].positions, b.positions)


@pytest.mark.parametrize(
    ("text", "line", "what"),
    [
        ("3\nwater\nO 0 0 0\nH 0 0 1\nH 0 1 x\n", 5, "not numbers"),
        ("3\nwater\nO 0 0 0\nH 0 0 1\n", 5, "declares 3 atoms"),
        ("3\nwater\nO 0 0 0\nH 0 0 1\nH 0 1 0\ntwo\nc\n", 6, "atom count"),
        ("2\nh2\nH 0 0 0\nQq 0 0 0.7\n", 4, "unknown element"),
        ("2\nh2\nH 0 0\nH 0 0 0.7\n", 3, "symbol x y z"),
    ],
)
def test_malformed_xyz_names_file_and_line(tmp_path, text, line, what):
    f = tmp_path / "bad.xyz"
    f.write_text(text)
    with pytest.raises(InputError) as err:
        xyz_molecules(f)
    assert f"{f}:{line}:" in err.value.message
    assert what in err.value.message
    assert err.value.hint


def test_malformed_xyz_quarantine_keeps_frames_before(tmp_path):
    f = tmp_path / "part.xyz"
    f.write_text("2\nh2\nH 0 0 0\nH 0 0 0.74\n3\nbad\nO 0 0 0\nH 0 0 1\n")
    mols, rejected = xyz_molecules(f, on_bad_input="quarantine")
    assert len(mols) == 1 and mols[0].n_atoms == 2
    assert rejected and rejected[0].where.endswith(":9")


def test_unknown_source_and_empty_filter():
    with pytest.raises(InputError, match="unknown molecule source"):
        load_molecules("qm9-please")
    with pytest.raises(InputError, match="no molecule passes"):
        load_molecules("g2", ["Xe"], 2, 12)


def test_extxyz_properties_columns_are_respected(tmp_path):
    f = tmp_path / "cols.extxyz"
    f.write_text(
        "2\nProperties=pos:R:3:species:S:1:forces:R:3 energy=-1.0\n"
        "0.0 0.0 0.0 H 0 0 0\n0.0 0.0 0.74 H 0 0 0\n"
    )
    mols, _ = xyz_molecules(f)
    assert mols[0].symbols == ["H", "H"]
    np.testing.assert_allclose(mols[0].positions[1], [0.0, 0.0, 0.74])
    f.write_text("2\nProperties=pos:R:3:species:S:1\n0.0 0.0 0.0 H\n0.0 0.0 nope H\n")
    with pytest.raises(InputError, match=r"cols\.extxyz:4: .*not numbers"):
        xyz_molecules(f)
