"""`data pack` and the dataset files at the user's edges: one file, molecule ids of
multi-frame files, FILE:LINE errors, nothing left behind, permissions, leftover cleaning."""

from __future__ import annotations

import os
import stat
import time

import numpy as np
import pytest

from convergent.core.errors import InputError
from convergent.data.pack import frame_molecule_ids, pack_directory
from convergent.data.reader import open_dataset, split_by_molecule
from convergent.data.verify import clean_leftovers, verify_dataset


def _frames():
    from ase import Atoms

    water = [Atoms("H2O", positions=[[0, 0, 0], [0.96, 0, 0], [-0.24, 0.93, 0.01 * i]],
                   info={"energy": -14.0 - i}) for i in range(3)]
    methane = [Atoms("CH4", positions=[[0, 0, 0], [1.09, 0, 0], [0, 1.09, 0], [0, 0, 1.09],
                                       [-0.6, -0.6, -0.6 + 0.01 * i]], info={"energy": -24.0 - i})
               for i in range(2)]
    return water, methane


def _write(path, frames):
    from ase.io import write

    write(path, frames, format="extxyz")
    return path


def test_a_single_file_packs_and_each_molecule_of_it_gets_its_own_id(tmp_path):
    from convergent.data.identity import chemical_id

    water, methane = _frames()
    f = _write(tmp_path / "mixed.extxyz", [*water, *methane])
    m = pack_directory(f, tmp_path / "ds")
    assert m.schema == "molecular" and m.records == 5
    ds = open_dataset(tmp_path / "ds")
    recs = list(ds)
    # ids by chemistry: the water frames share one, methane has another
    h2o, ch4 = chemical_id(water[0].numbers, water[0].positions), \
        chemical_id(methane[0].numbers, methane[0].positions)
    assert h2o.startswith("H2O-") and ch4.startswith("CH4-")
    assert [r["molecule_id"] for r in recs] == [h2o] * 3 + [ch4] * 2
    assert [r["meta"]["file"] for r in recs] == [
        "mixed.extxyz:1", "mixed.extxyz:6", "mixed.extxyz:11", "mixed.extxyz:16", "mixed.extxyz:23"]
    assert [r["meta"]["source"] for r in recs] == [r["meta"]["file"] for r in recs]
    train, val = split_by_molecule(ds, 0.5, seed=0)
    mids = ds.molecule_ids()
    assert not {mids[i] for i in train} & {mids[i] for i in val}
    # an explicit molecule_id wins
    water[1].info["molecule_id"] = "special"
    assert frame_molecule_ids("w", water) == [h2o, "special", h2o]
    assert frame_molecule_ids("x", [water[0], methane[0], water[1]]) == [h2o, ch4, "special"]
    # a periodic frame has no chemical id: the file's rule (runs of the same atoms)
    cell = [water[0].copy(), water[2].copy()]
    for a in cell:
        a.set_cell([10, 10, 10])
        a.pbc = True
    assert frame_molecule_ids("c", cell) == ["c", "c"]


def test_frames_interleaved_by_molecule_get_ids_by_chemistry_and_keep_their_source(tmp_path):
    """Issue 37: an ASE-written file of several molecules in no order (as a user's extxyz
    is): ids by frame position made every frame a 'molecule' and the split leaked."""
    from ase.build import molecule

    names = ["H2O", "CH4", "NH3", "CH3OH", "C2H6"]
    frames = []
    for k in range(30):
        a = molecule(names[(k * 7) % len(names)])
        a.rattle(0.03, seed=k)
        a.info.update(energy=-float(k), source=f"run{k % 3}")
        frames.append(a)
    pack_directory(_write(tmp_path / "mixed.extxyz", frames), tmp_path / "ds")
    ds = open_dataset(tmp_path / "ds")
    recs = list(ds)
    by_id: dict[str, set[str]] = {}
    for r in recs:
        by_id.setdefault(r["molecule_id"], set()).add(r["molecule_id"].split("-")[0])
    assert len(by_id) == len(names)  # one id per molecule, not per frame
    assert [r["meta"]["source"] for r in recs] == [f"run{k % 3}" for k in range(30)]
    train, val = split_by_molecule(ds, 0.4, seed=0)
    mids = ds.molecule_ids()
    formulas = [r["molecule_id"].split("-")[0] for r in recs]
    assert not {formulas[i] for i in train} & {formulas[i] for i in val}
    assert {mids[i] for i in train} and {mids[i] for i in val}


def test_isomers_get_different_ids_and_one_molecule_in_two_files_one_id(tmp_path):
    from ase.build import molecule

    from convergent.data.identity import chemical_id

    ethanol, dme = molecule("CH3CH2OH"), molecule("CH3OCH3")  # both C2H6O
    a, b = chemical_id(ethanol.numbers, ethanol.positions), chemical_id(dme.numbers, dme.positions)
    assert a.startswith("C2H6O-") and b.startswith("C2H6O-") and a != b
    water, _ = _frames()
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "b").mkdir()
    _write(tmp_path / "src" / "a" / "w.xyz", water[0])
    _write(tmp_path / "src" / "b" / "w.xyz", water[1])
    pack_directory(tmp_path / "src", tmp_path / "ds")
    ids = open_dataset(tmp_path / "ds").molecule_ids()
    assert len(ids) == 2 and len(set(ids)) == 1 and ids[0].startswith("H2O-")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_malformed_file_names_its_line_and_leaves_no_output_directory(tmp_path, workers):
    water, _ = _frames()
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        _write(src / f"ok{i}.extxyz", water)
    bad = src / "zz.extxyz"
    bad.write_text("2\nenergy=1\nH 0 0 0\nH 0 zero 0.7\n")
    client = cluster = None
    if workers:
        from dask.distributed import Client, LocalCluster

        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=False,
                               dashboard_address=None)
        client = Client(cluster)
    try:
        with pytest.raises(InputError) as err:
            pack_directory(src, tmp_path / "out", workers=workers, client=client)
        assert err.value.message.startswith(
            f"{bad}:4: malformed xyz/extxyz: coordinates are not numbers")
        assert not (tmp_path / "out").exists()
        bad.unlink()  # fixed: the same command works
        assert pack_directory(src, tmp_path / "out", workers=workers, client=client).records == 12
    finally:
        if client is not None:
            client.close()
            cluster.close()


def test_an_extxyz_comment_error_is_located(tmp_path):
    f = tmp_path / "c.extxyz"
    f.write_text("1\nenergy=1\nH 0 0 0\n2\nProperties=species:S:1:pos:R:3:forces:R:3\n"
                 "H 0 0 0\nH 0 0 0.7\n")
    with pytest.raises(InputError, match=rf"^{f}:5: malformed extxyz comment line"):
        pack_directory(f, tmp_path / "ds")
    from convergent.screen.predict import read_structures

    with pytest.raises(InputError, match=rf"^{f}:5: "):
        read_structures(f)
    g = tmp_path / "g.xyz"
    g.write_text("3\n\nO 0 0 0\nH 1 0 0\n")
    with pytest.raises(InputError, match=rf"^{g}:5: malformed xyz/extxyz: frame starting at line 1 declares 3"):
        read_structures(g)


def test_an_existing_output_is_kept_when_a_pack_fails(tmp_path):
    water, _ = _frames()
    f = _write(tmp_path / "w.extxyz", water)
    pack_directory(f, tmp_path / "ds")
    before = sorted(p.name for p in (tmp_path / "ds").iterdir())
    f.write_text("x\n")
    with pytest.raises(InputError, match=":1: malformed"):
        pack_directory(f, tmp_path / "ds", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == before
    assert len(open_dataset(tmp_path / "ds")) == 3


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_datasets_are_as_readable_as_the_umask_allows(tmp_path, umask, mode):
    water, _ = _frames()
    f = _write(tmp_path / "w.extxyz", water)
    old = os.umask(umask)
    try:
        pack_directory(f, tmp_path / "ds")
    finally:
        os.umask(old)
    files = list((tmp_path / "ds").iterdir())
    assert len(files) == 2  # manifest + one shard
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {mode}


def test_verify_reports_stray_temp_files_and_clean_removes_old_leftovers(tmp_path):
    water, _ = _frames()
    pack_directory(_write(tmp_path / "w.extxyz", water), tmp_path / "ds")
    ds = tmp_path / "ds"
    shard = next(ds.glob("shard-*.cvs"))
    old_tmp = ds / f".{shard.name}.abc123.tmp"
    new_tmp = ds / ".shard-x-000001.cvs.def456.tmp"
    orphan = ds / "shard-orphan-000000.cvs"
    for p in (old_tmp, new_tmp, orphan):
        p.write_bytes(b"partial")
    hours_ago = time.time() - 7200
    os.utime(old_tmp, (hours_ago, hours_ago))
    os.utime(orphan, (hours_ago, hours_ago))
    rep = verify_dataset(ds)
    assert rep.ok and rep.temp_files == sorted([old_tmp.name, new_tmp.name])
    assert rep.orphans == [orphan.name]
    removed, recent = clean_leftovers(ds, min_age_s=3600)
    assert sorted(removed) == sorted([old_tmp.name, orphan.name]) and recent == [new_tmp.name]
    assert shard.exists() and new_tmp.exists() and not old_tmp.exists()
    assert verify_dataset(ds).ok and len(open_dataset(ds)) == 3


def test_cli_verify_clean(tmp_path, capsys):
    from convergent.cli import main

    water, _ = _frames()
    pack_directory(_write(tmp_path / "w.extxyz", water), tmp_path / "ds")
    stray = tmp_path / "ds" / ".shard-q-000000.cvs.zz.tmp"
    stray.write_bytes(b"x")
    assert main(["data", "verify", str(tmp_path / "ds")]) == 0
    assert f"note: {stray.name} is a temporary file" in capsys.readouterr().out
    assert main(["data", "verify", str(tmp_path / "ds"), "--clean", "--min-age", "0"]) == 0
    assert f"removed: {stray.name}" in capsys.readouterr().out and not stray.exists()
    np.testing.assert_array_equal(open_dataset(tmp_path / "ds")[0]["numbers"], [1, 1, 8])
