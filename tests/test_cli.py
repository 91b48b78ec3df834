"""The CLI as a user meets it: real subprocesses of the installed console script."""

from __future__ import annotations

import subprocess

import pytest

from tests.cli_exe import EXE


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_help_lists_every_stage():
    out = run("--help")
    assert out.returncode == 0
    for stage in ("demo", "simulate", "data", "train", "screen", "report", "serve"):
        assert stage in out.stdout


def test_version():
    out = run("--version")
    assert out.returncode == 0 and out.stdout.startswith("convergent ")


@pytest.mark.parametrize(
    "args, needle",
    [
        (("train", "--set", "train.lr=abc"), "train.lr"),
        (("train", "missing-config.yaml"), "missing-config.yaml"),
        (("demo", "--set", "nosuch.key=1"), "nosuch.key"),
        # refused before torchrun starts, not as a rank's traceback
        (("train", "--nproc", "2"), "train.dataset is not set"),
        (("train", "--set", "train.dataset=no/such/dir"), "no/such/dir does not exist"),
        (("train", "--set", "train.dataset=x", "--set", "parallel.strategy=pipeline"), "model.forces=direct"),
    ],
)
def test_user_mistakes_are_one_line_exit_2_no_traceback(args, needle, tmp_path):
    out = run(*args, cwd=tmp_path)
    assert out.returncode == 2
    first = out.stderr.splitlines()[0]
    assert first.startswith("error: ") and needle in first
    assert "Traceback" not in out.stderr


def test_debug_shows_the_traceback(tmp_path):
    out = run("--debug", "train", "--set", "train.lr=abc", cwd=tmp_path)
    assert out.returncode != 0 and "Traceback" in out.stderr


def test_report_on_missing_run_dir_is_a_clear_error(tmp_path):
    out = run("report", str(tmp_path / "nope"))
    assert out.returncode == 2 and "nope" in out.stderr.splitlines()[0]
