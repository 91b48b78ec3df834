"""Atomic writes: all or nothing, usual permissions."""

from __future__ import annotations

import os
import stat

import pytest

from convergent.core.fsutil import atomic_open, atomic_write_text


def test_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "m.json"
    atomic_write_text(target, "old")
    with pytest.raises(RuntimeError), atomic_open(target, "w") as fh:
        fh.write("half")
        raise RuntimeError("crash mid-write")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["m.json"]


def test_written_file_is_readable_by_others_under_umask_022(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "r.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == 0o644
