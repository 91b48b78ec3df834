"""Run directories: created with their layout, resumed or refused, never overwritten."""

from __future__ import annotations

import pytest

from convergent.config import ConvergentConfig, load_config
from convergent.core.errors import RunDirError
from convergent.runsdb.rundir import open_run


def test_new_run_has_layout_and_resolved_config(tmp_path):
    cfg = load_config(None, ["train.steps=5"])
    run = open_run(cfg, tmp_path / "r1")
    for sub in ("logs", "ckpt", "data", "report"):
        assert (run.path / sub).is_dir()
    assert load_config(run.config) == cfg


def test_existing_run_is_refused_without_resume_and_left_intact(tmp_path):
    cfg = ConvergentConfig()
    run = open_run(cfg, tmp_path / "r")
    run.log_metrics({"kind": "x", "v": 1})
    before = run.metrics.read_text()
    with pytest.raises(RunDirError, match="already exists"):
        open_run(cfg, tmp_path / "r")
    assert run.metrics.read_text() == before


def test_resume_requires_same_config(tmp_path):
    cfg = ConvergentConfig()
    open_run(cfg, tmp_path / "r").mark_done("simulate", {"frames": 3})
    resumed = open_run(cfg, tmp_path / "r", resume=True)
    assert resumed.is_done("simulate") and resumed.stages()["simulate"]["frames"] == 3
    with pytest.raises(RunDirError, match="different config"):
        open_run(load_config(None, ["train.steps=1"]), tmp_path / "r", resume=True)


def test_foreign_non_empty_directory_is_refused(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "precious.txt").write_text("keep me")
    with pytest.raises(RunDirError, match="not a convergent run"):
        open_run(ConvergentConfig(), tmp_path / "r", resume=True)
    assert (tmp_path / "r" / "precious.txt").read_text() == "keep me"


def test_metrics_reader_skips_a_torn_last_line(tmp_path):
    run = open_run(ConvergentConfig(), tmp_path / "r")
    run.log_metrics({"kind": "train_step", "step": 1})
    with run.metrics.open("a") as fh:
        fh.write('{"kind": "train_st')
    assert [r["step"] for r in run.read_metrics("train_step")] == [1]


def test_default_run_directory_is_named_after_the_command(tmp_path):
    cfg = load_config(None, [f"run.root={tmp_path}"])
    assert open_run(cfg, command="train").path == tmp_path / "train"
    assert open_run(cfg, command="demo").path == tmp_path / "demo"  # no collision
    named = load_config(None, [f"run.root={tmp_path}", "run.name=mine"])
    assert open_run(named, command="train").path == tmp_path / "mine"


def test_a_failed_check_creates_nothing(tmp_path):
    from convergent.core.errors import InputError

    def check():
        raise InputError("bad input")

    with pytest.raises(InputError):
        open_run(ConvergentConfig(), tmp_path / "r", check=check)
    assert not (tmp_path / "r").exists()


def test_a_run_whose_start_failed_is_started_again_by_the_fixed_command(tmp_path):
    first = load_config(None, ["train.steps=5"])
    run = open_run(first, tmp_path / "r")
    (run.logs / "torchrun.log").write_text("a failed start\n")  # logs alone are no result
    fixed = load_config(None, ["train.steps=6"])
    again = open_run(fixed, tmp_path / "r")  # no --resume needed, a new config is fine
    assert load_config(again.config) == fixed
    assert (run.logs / "torchrun.log").exists()
    again.log_metrics({"kind": "train_step", "step": 1})  # now it has a result
    with pytest.raises(RunDirError, match="already exists"):
        open_run(fixed, tmp_path / "r")
    with pytest.raises(RunDirError, match="different config"):
        open_run(first, tmp_path / "r", resume=True)


def test_a_file_where_the_run_directory_should_be_is_refused(tmp_path):
    (tmp_path / "r").write_text("x")
    with pytest.raises(RunDirError, match="not a directory"):
        open_run(ConvergentConfig(), tmp_path / "r")


def test_a_run_in_use_by_another_process_is_refused(tmp_path):
    import subprocess
    import sys

    code = ("import sys; from convergent.config import ConvergentConfig; "
            "from convergent.runsdb.rundir import open_run; "
            f"open_run(ConvergentConfig(), {str(tmp_path / 'r')!r}); print('ready', flush=True); "
            "sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        with pytest.raises(RunDirError, match=rf"in use by another process \(pid {child.pid}\)"):
            open_run(ConvergentConfig(), tmp_path / "r")
    finally:
        child.communicate("", timeout=60)
    # the holder has exited (its start produced nothing): the same command starts again
    assert open_run(ConvergentConfig(), tmp_path / "r").config.exists()
