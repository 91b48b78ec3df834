"""`data inspect` and `data export` (webdataset tar readable with tarfile; mds in test_mds.py)."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile

import numpy as np
import pytest

from convergent.data.export import export_dataset
from convergent.data.inspect import inspect_dataset
from convergent.data.writer import DatasetWriter
from tests.cli_exe import EXE
from tests.data.datarecords import bytes_records


def test_inspect_reports_counts_elements_and_energy(small_molecular):
    path, recs = small_molecular
    info = inspect_dataset(path)
    assert info["records"] == 300 and info["schema"] == "molecular" and info["molecules"] == 7
    e = np.array([r["energy"] for r in recs])
    assert info["energy_eV"]["mean"] == pytest.approx(e.mean()) and info["energy_eV"]["min"] == e.min()
    z = np.concatenate([r["numbers"] for r in recs])
    assert info["elements"]["C"] == int((z == 6).sum()) and info["elements"]["H"] == int((z == 1).sum())
    out = subprocess.run([EXE, "data", "inspect", str(path), "--json"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and json.loads(out.stdout)["records"] == 300


def test_export_webdataset_same_records(tmp_path):
    recs = bytes_records(40, max_size=5000)
    with DatasetWriter(tmp_path / "b", schema="bytes") as w:
        w.write_many(recs)
    names = export_dataset(tmp_path / "b", tmp_path / "wds", "webdataset", shard_bytes=30_000)
    assert len(names) > 1
    got = {}
    for n in names:
        with tarfile.open(tmp_path / "wds" / n) as tf:
            members = {m.name: tf.extractfile(m).read() for m in tf.getmembers()}
        for name, data in members.items():
            if name.endswith(".key"):
                got[data.decode()] = members[name[:-4] + ".bin"]
    assert got == {r["key"]: r["payload"] for r in recs}


def test_export_webdataset_molecular(small_molecular, tmp_path):
    path, recs = small_molecular
    names = export_dataset(path, tmp_path / "wds", "webdataset")
    with tarfile.open(tmp_path / "wds" / names[0]) as tf:
        arr = np.load(io.BytesIO(tf.extractfile("000000005.npz").read()))
        scal = json.loads(tf.extractfile("000000005.json").read())
    np.testing.assert_array_equal(arr["positions"], recs[5]["positions"])
    assert scal["key"] == "r5" and scal["energy"] == recs[5]["energy"]


def test_export_unknown_format_is_exit_2(small_molecular, tmp_path):
    path, _ = small_molecular
    out = subprocess.run([EXE, "data", "export", str(path), str(tmp_path / "x"), "--to", "parquet"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "parquet" in out.stderr.splitlines()[0]
