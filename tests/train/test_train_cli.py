"""`convergent train`: the launch command it prints, and a real 2-process run."""

from __future__ import annotations

import json

import pytest

from convergent.cli import main
from convergent.runsdb.trainrecords import parse_train_records
from tests.train.trainhelpers import LM_BASE


def _sets(items):
    out = []
    for item in items:
        out += ["--set", item]
    return out


def test_print_launch_standalone(tmp_path, capsys):
    code = main(["train", "--print-launch", "--nproc", "3", "--max-restarts", "2",
                 "--run-dir", str(tmp_path / "r")])
    assert code == 0
    line = capsys.readouterr().out.strip()
    assert "torch.distributed.run --standalone" in line
    assert "--nproc-per-node=3" in line and "--max-restarts=2" in line
    assert "convergent.train.main" in line and not (tmp_path / "r").exists()


def test_print_launch_inside_slurm(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[10-11]")
    assert main(["train", "--print-launch", "--nnodes", "2", "--run-dir", str(tmp_path)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("srun ") and "--rdzv-endpoint=node10:29500" in line


def test_train_command_runs_two_processes(tmp_path, capsys):
    run_dir = tmp_path / "lm"
    code = main(["train", *_sets([*LM_BASE, "parallel.strategy=ddp", "metrics.log_every=1"]),
                 "--nproc", "2", "--run-dir", str(run_dir)])
    assert code == 0
    out = capsys.readouterr().out
    assert "step 5/5" in out and "trained 5 steps" in out
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps, _ = parse_train_records(rows)
    assert [r.step for r in steps] == [1, 2, 3, 4, 5]
    first = steps[0]
    assert first.unit == "tokens" and first.units_per_s > 0 and first.extra == {}
    assert first.comm_s is not None and first.peak_mem_bytes is not None
    assert "placement: 2 x cpu (gloo)" in out
    placed = [r for r in rows if r["kind"] == "placement"]  # what the job ran on
    assert len(placed) == 1 and placed[0]["device"] == "cpu"
    assert placed[0]["backend"] == "gloo" and placed[0]["world"] == 2
    assert placed[0]["dtype"] == "fp32" and placed[0]["gpu_names"] == []
    assert (run_dir / "ckpt" / "final" / "model.safetensors").exists()
    # the stage's cost record for `runs cost`: 2 processes x 1 thread, and the code version
    stage = json.loads((run_dir / "stages.json").read_text())["train"]
    assert stage["cores"] == 2 and stage["wall_s"] > 0 and stage["steps"] == 5
    assert stage["code"]["commit"]
    assert {r.attempt for r in steps} == {0}
    # a second invocation without --resume refuses to touch the run
    assert main(["train", *_sets([*LM_BASE, "parallel.strategy=ddp", "metrics.log_every=1"]),
                 "--run-dir", str(run_dir)]) == 2


def test_bad_dataset_is_refused_before_the_run_directory_exists(tmp_path, capsys):
    (tmp_path / "nope").mkdir()  # exists but holds no dataset
    code = main(["train", "--set", f"train.dataset={tmp_path / 'nope'}", "--set",
                 "train.steps=1", "--nproc", "1", "--set", "parallel.strategy=single",
                 "--run-dir", str(tmp_path / "r")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: train.dataset: ") and "nope" in err and "manifest.json" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


def test_a_shard_error_inside_training_is_one_line_and_the_fixed_retry_runs(
        moldata, tmp_path, capsys):
    import shutil

    from tests.train.trainhelpers import mol_overrides

    train = tmp_path / "train"
    shutil.copytree(moldata[0], train)
    shard = sorted(train.glob("shard-*"))[0]
    good = shard.read_bytes()
    shard.write_bytes(good[: len(good) // 2])  # truncated: the ranks fail opening it
    args = ["train", *_sets([*mol_overrides((train, moldata[1])), "train.steps=2",
                             "parallel.strategy=single", "train.val_every=0"]),
            "--run-dir", str(tmp_path / "r")]
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: training failed on rank 0: shard ")
    assert shard.name in lines[0] and "rank0.log" in lines[0]
    shard.write_bytes(good)  # repaired: the same command starts the run again
    assert main(args) == 0
    assert "trained 2 steps" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ["parallel.strategy=ddp", "checkpoint.async_save=true", "checkpoint.interval=2"],
        ["parallel.strategy=fsdp", "precision.dtype=fp16"],
        ["parallel.strategy=single", "train.compile=true"],
    ],
)
def test_train_options_run(tmp_path, extra):
    nproc = "1" if "parallel.strategy=single" in extra else "2"
    code = main(["train", *_sets([*LM_BASE, *extra]), "--nproc", nproc,
                 "--run-dir", str(tmp_path / "r")])
    assert code == 0
    done = sorted(p.name for p in (tmp_path / "r" / "ckpt").glob("step_*") if (p / "COMPLETE").exists())
    assert done[-1] == "step_00000005"
