"""Placement rules (pure functions of the visible GPU count) and their CLI errors."""

from __future__ import annotations

import pytest

from convergent.cluster.placement import check_serve_stages, gpu_names, plan_training, visible_gpus
from convergent.core.errors import ConfigError


def test_auto_is_one_rank_per_gpu_on_cuda_and_two_on_cpu():
    cuda = plan_training("auto", "auto", "ddp", "auto", gpus=4, names=["H100"] * 4)
    assert (cuda.device, cuda.nproc, cuda.backend, cuda.gpus) == ("cuda", 4, "nccl", 4)
    assert cuda.record()["gpu_names"] == ["H100"] * 4
    cpu = plan_training("auto", "auto", "ddp", "auto", gpus=0)
    assert (cpu.device, cpu.nproc, cpu.backend) == ("cpu", 2, "gloo")
    pinned = plan_training("cpu", "auto", "ddp", "auto", gpus=8)  # GPUs ignored
    assert (pinned.device, pinned.nproc, pinned.backend, pinned.gpus) == ("cpu", 2, "gloo", 0)
    assert plan_training("auto", 3, "single", "auto", gpus=1).nproc == 1
    assert plan_training("auto", 2, "ddp", "gloo", gpus=2).backend == "gloo"


def test_more_ranks_than_gpus_names_the_field_the_count_and_the_fix():
    with pytest.raises(ConfigError) as e:
        plan_training("auto", 2, "ddp", "auto", gpus=1)
    assert "parallel.nproc=2" in str(e.value) and "1 GPU is visible" in str(e.value)
    assert "train.device=cpu" in e.value.hint
    assert plan_training("auto", 4, "ddp", "auto", gpus=1, fit=False).nproc == 4  # printed
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        plan_training("cuda", "auto", "ddp", "auto", gpus=0)
    with pytest.raises(ConfigError, match="parallel.backend=nccl"):
        plan_training("cpu", 2, "ddp", "nccl", gpus=0)


def test_serving_stages_need_one_gpu_each():
    check_serve_stages("cpu", 4, 0)  # CPU stages: any number
    check_serve_stages("cuda", 2, 2)
    with pytest.raises(ConfigError) as e:
        check_serve_stages("cuda", 2, 1)
    assert "serve.scheduler.stages=2" in str(e.value) and "1 GPU is visible" in str(e.value)
    assert "serve.engine.device=cpu" in e.value.hint


def test_slurm_gpu_binding_counts():
    assert visible_gpus({"SLURM_GPUS_ON_NODE": "4"}) == 4
    assert visible_gpus({"SLURM_GPUS_ON_NODE": "0"}) == 0
    assert gpu_names({"CUDA_VISIBLE_DEVICES": ""}) == []  # none visible: no names


def test_nproc_config_accepts_auto_and_bounded_ints():
    from convergent.config import load_config

    assert load_config(None, []).parallel.nproc == "auto"
    assert load_config(None, ["parallel.nproc=3"]).parallel.nproc == 3
    with pytest.raises(ConfigError, match="parallel.nproc"):
        load_config(None, ["parallel.nproc=0"])


def test_cli_refuses_too_many_gpu_ranks_before_creating_the_run_dir(tmp_path, monkeypatch):
    """Slurm's binding says 1 GPU on this node: 2 ranks on CUDA is refused with exit 2
    and no run directory is made; the same on the CPU is accepted (printed launch)."""
    from convergent.cli import main

    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "1")
    run_dir = tmp_path / "run"
    args = ["train", "-s", "model.kind=llama", "-s", "train.device=cuda", "--nproc", "2",
            "--run-dir", str(run_dir)]
    assert main(args) == 2
    assert not run_dir.exists()
    assert main([*args, "--print-launch"]) == 0  # a command for other nodes: printed
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "0")
    ok = ["train", "-s", "model.kind=llama", "-s", "train.device=cpu", "--print-launch",
          "--run-dir", str(run_dir)]
    assert main(ok) == 0
    assert not run_dir.exists()
