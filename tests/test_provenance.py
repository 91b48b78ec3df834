"""The code version in records: git commit + dirty flag, and 'unknown' outside a checkout."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from convergent.core.provenance import UNKNOWN, CodeVersion, code_version, git_version

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


@needs_git
def test_commit_and_dirty_flag_of_a_checkout(tmp_path):
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "f.py").write_text("x = 1\n")
    git("add", "f.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    clean = git_version(tmp_path)
    assert clean == CodeVersion(git("rev-parse", "HEAD"), False)
    (tmp_path / "untracked.txt").write_text("not code")
    assert git_version(tmp_path).dirty is False  # untracked files do not make it dirty
    (tmp_path / "f.py").write_text("x = 2\n")
    dirty = git_version(tmp_path)
    assert dirty.commit == clean.commit and dirty.dirty is True
    assert dirty.short == clean.commit[:7] + "+dirty"


def test_outside_a_checkout_is_unknown(tmp_path):
    v = git_version(tmp_path)
    assert (v.commit, v.dirty, v.short) == (UNKNOWN, None, UNKNOWN)
    assert CodeVersion.from_dict(v.to_dict()) == v


def test_this_package_version_is_cached():
    assert code_version() is code_version()


def test_exported_model_records_the_code(tmp_path):
    from convergent.models.config import ModelConfig
    from convergent.models.io import save_model
    from convergent.models.molecular import build_model

    cfg = ModelConfig(hidden=16, layers=1, heads=2)
    save_model(build_model(cfg), cfg, tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "model_config.json").read_text())
    assert meta["code"] == code_version().to_dict()
