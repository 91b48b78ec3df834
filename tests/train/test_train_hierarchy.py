"""Hierarchical all-reduce (convergent.train.hierarchy): same gradients as flat DDP.

Real gloo, 8 processes under torchrun on this machine (no root needed): the node map is
given explicitly, so 4 "nodes" x 2 ranks, a scattered placement, explicit groups and a
rack tier (2 racks x 2 nodes x 2 ranks) are all exercised on one host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from convergent.core.errors import ConfigError
from convergent.train.hierarchy import Tiers, build_tiers, choose_algorithm

HERE = Path(__file__).resolve().parent


def test_tiers_levels_and_auto_choice() -> None:
    t = build_tiers(["a", "a", "b", "b"])
    assert t.nodes == [[0, 1], [2, 3]]
    assert t.levels() == [[[0, 1], [2, 3]], [[0, 2], [1, 3]]]
    assert choose_algorithm("auto", t) == "hierarchical"
    assert choose_algorithm("auto", build_tiers(["a", "a"])) == "flat"  # one node
    assert choose_algorithm("auto", build_tiers(["a", "b"])) == "flat"  # 1 rank per node
    assert choose_algorithm("flat", t) == "flat"
    three = build_tiers([0, 0, 1, 1, 2, 2, 3, 3], {0: "x", 1: "x", 2: "y", 3: "y"})
    assert three == Tiers([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    assert [len(lvl[0]) for lvl in three.levels()] == [2, 2, 2]
    assert three.levels()[2] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # one per (node, local)


def test_unequal_nodes_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="equal ranks per node"):
        build_tiers(["a", "a", "a", "b"])
    with pytest.raises(ConfigError, match="exactly once"):
        build_tiers([0, 0, 1, 1], groups=[[0, 1], [1, 3]])


def test_hierarchical_gradients_equal_flat(tmp_path: Path) -> None:
    out = tmp_path / "res.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=8",
         "--master_port=0", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0",
         str(HERE / "hier_worker.py"), str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    n = res["n_params"]
    for name in ("two_tier", "scattered", "three_tier", "explicit_groups", "topk_full",
                 "topk_3tier", "powersgd_warmup"):
        assert res[name]["max_abs_diff"] <= 1e-5 * max(1.0, res[name]["scale"]), (name, res)
    # fp16 on the slow hop only: close, not exact
    assert res["fp16"]["max_abs_diff"] <= 2e-3 * max(1.0, res["fp16"]["scale"]), res
    assert res["fp16"]["max_abs_diff"] > 0
    # slow-hop payload per rank per step: 1/(ranks per node) of the (padded) gradient
    per_rank = res["two_tier"]["slow_bytes"] / 2  # two steps
    assert n * 4 / 2 <= per_rank <= n * 4 / 2 + 64 * 4
    assert res["fp16"]["slow_bytes"] == res["two_tier"]["slow_bytes"] / 2
