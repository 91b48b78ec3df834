"""Pure-Python parts of the engine: topology, launch commands, batch plans, precision,
and checkpoints in one process (DCP without a process group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from convergent.core.errors import ConfigError
from convergent.train.topology import expand_hostlist, group_ranks, read_topology_file


def test_expand_slurm_hostlist():
    assert expand_hostlist("cn[001-003,010],gpu7") == ["cn001", "cn002", "cn003", "cn010", "gpu7"]
    assert expand_hostlist("a1,b[2-3]x") == ["a1", "b2x", "b3x"]


def test_group_ranks_by_node_rack_and_file(tmp_path):
    hosts = ["n1", "n1", "n2", "n2", "n3", "n3", "n4", "n4"]
    assert group_ranks(8, hosts).mesh == [[0, 1], [2, 3], [4, 5], [6, 7]]
    topo = {"racks": {"r1": ["n1", "n3"], "r2": "n[2,4]"}}
    layout = group_ranks(8, hosts, topology=topo, level="rack")
    assert layout.mesh == [[0, 1, 4, 5], [2, 3, 6, 7]]  # rank order follows racks
    assert (layout.replicate, layout.shard) == (2, 4)
    assert group_ranks(4, shard_size=2).mesh == [[0, 1], [2, 3]]
    f = tmp_path / "topo.yaml"
    f.write_text("groups: [[0, 2], [1, 3]]\n")
    assert group_ranks(4, topology=read_topology_file(f)).mesh == [[0, 2], [1, 3]]
    with pytest.raises(ConfigError):
        group_ranks(3, ["a", "a", "b"])  # unequal groups
    with pytest.raises(ConfigError):
        group_ranks(4, shard_size=3)
    (tmp_path / "bad.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        read_topology_file(tmp_path / "bad.yaml")


def test_build_command_standalone_and_slurm(tmp_path):
    from convergent.train.launch import build_command

    cmd = build_command(tmp_path / "c.yaml", tmp_path, 2, max_restarts=1, env={}, python="py")
    assert cmd[:3] == ["py", "-m", "torch.distributed.run"]
    assert "--standalone" in cmd and "--nproc-per-node=2" in cmd and "--max-restarts=1" in cmd
    assert cmd[-6:-4] == ["-m", "convergent.train.main"]
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "cn[07-08]"}
    cmd = build_command(tmp_path / "c.yaml", tmp_path, 4, nnodes=2, env=env, python="py")
    assert cmd[0] == "srun" and "--nodes=2" in cmd
    assert "--rdzv-endpoint=cn07:29500" in cmd and "--rdzv-id=42" in cmd
    assert "--standalone" not in cmd
    with pytest.raises(ConfigError, match="Slurm"):
        build_command(tmp_path / "c.yaml", tmp_path, 2, nnodes=2, env={})


def test_split_evenly_balances_and_fills_every_part():
    from convergent.train.tasks import split_evenly

    bins = split_evenly([5, 1, 9, 3, 3, 2], 3)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(bins)
    loads = [sum([5, 1, 9, 3, 3, 2][i] for i in b) for b in bins]
    assert max(loads) - min(loads) <= 5


def test_lm_plan_is_independent_of_world_size():
    from convergent.config import load_config
    from convergent.train.tasks import LMTask

    cfg = load_config(None, ["model.kind=llama", "train.global_batch_seqs=8", "train.seq_len=8"])
    task = LMTask(cfg)
    whole = task.micro_batches(3, 0, 1, 1)[0].data[0]
    parts = [task.micro_batches(3, r, 2, 2) for r in range(2)]
    # parts are ordered micro-step major: part p = a * world + rank
    pieces = [parts[r][a].data[0] for a in range(2) for r in range(2)]
    assert torch.equal(torch.cat(pieces), whole)
    assert not torch.equal(task.micro_batches(4, 0, 1, 1)[0].data[0], whole)


def test_keep_fp32_runs_module_in_fp32_under_autocast():
    from convergent.train.precision import keep_in_fp32

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    names = keep_in_fp32(model, ["1"], "cpu")
    assert names == ["1"]
    seen = {}
    def hook(m, i, o):
        seen["dtype"] = o.dtype

    model[1].register_forward_hook(hook)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(3, 4))
    assert seen["dtype"] == torch.float32 and out.dtype == torch.float32


def test_checkpoint_save_resume_retention_single_process(tmp_path):
    from convergent.train.checkpoint import (
        CheckpointManager,
        complete_checkpoints,
        latest_checkpoint,
        load_full_model,
    )

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    mgr = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3):
        mgr.save(step, [model], [opt], {"step": step, "note": "x"}, local={"own": step})
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 3]
    (tmp_path / "step_00000009").mkdir()  # an incomplete write is never resumed from
    assert latest_checkpoint(tmp_path).name == "step_00000003"
    torch.manual_seed(1)
    fresh = nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    extra = CheckpointManager(tmp_path, keep=2).load(
        latest_checkpoint(tmp_path), [fresh], [fresh_opt]
    )
    # the replicated extras, plus this rank's own state (same world size)
    assert extra == {"step": 3, "note": "x", "local": {"own": 3}}
    assert torch.equal(fresh.weight, model.weight)
    s_old = opt.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], s_old)
    plain = load_full_model(latest_checkpoint(tmp_path), nn.Linear(3, 2))
    assert torch.equal(plain.bias, model.bias)
