"""torchrun worker for test_train_hierarchy: gradients of hierarchical vs flat DDP.

Every rank computes DDP gradients of the same model on its own batch, once with the
default flat all-reduce and once per hierarchical variant (node maps and compressions),
and rank 0 writes the max abs difference per variant to the JSON path in argv[1].
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from convergent.train.compression import CommStats
from convergent.train.hierarchy import build_tiers, register_hierarchical


def model() -> nn.Module:
    torch.manual_seed(0)  # same initial weights everywhere
    return nn.Sequential(nn.Linear(13, 37), nn.Tanh(), nn.Linear(37, 29), nn.Tanh(),
                         nn.Linear(29, 3))


def grads(hook: dict | None, steps: int = 2) -> tuple[list[torch.Tensor], int]:
    m = model()
    ddp = DDP(m, bucket_cap_mb=0.002)  # several buckets of odd sizes (padding)
    stats = CommStats()
    if hook is not None:
        pcfg = SimpleNamespace(compression=hook["compression"], topk_ratio=hook["ratio"],
                               powersgd_rank=2, powersgd_start_iter=100)
        register_hierarchical(ddp, pcfg, stats, hook["tiers"])
    rank = dist.get_rank()
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(8, 13, generator=g)
        ddp.zero_grad()
        ddp(x).pow(2).sum().backward()
        out = [p.grad.detach().clone() for p in m.parameters()]
    return out, stats.bytes


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    assert world == 8
    contiguous = [r // 2 for r in range(world)]  # 4 nodes x 2 ranks
    scattered = [r % 4 for r in range(world)]  # node n holds ranks n and n+4
    racks = build_tiers(contiguous, {0: "a", 1: "a", 2: "b", 3: "b"})  # 2 x 2 x 2
    variants = {
        "two_tier": dict(tiers=build_tiers(contiguous), compression="none", ratio=1.0),
        "scattered": dict(tiers=build_tiers(scattered), compression="none", ratio=1.0),
        "three_tier": dict(tiers=racks, compression="none", ratio=1.0),
        "explicit_groups": dict(tiers=build_tiers(contiguous, groups=[[0, 7], [1, 6], [2, 5],
                                                                      [3, 4]]),
                                compression="none", ratio=1.0),
        "fp16": dict(tiers=build_tiers(contiguous), compression="fp16", ratio=1.0),
        "topk_full": dict(tiers=build_tiers(contiguous), compression="topk", ratio=1.0),
        "topk_3tier": dict(tiers=racks, compression="topk", ratio=1.0),
        "powersgd_warmup": dict(tiers=build_tiers(contiguous), compression="powersgd",
                                ratio=1.0),
    }
    ref, _ = grads(None)
    res = {}
    for name, v in variants.items():
        got, nbytes = grads(v)
        res[name] = {"max_abs_diff": max(float((a - b).abs().max()) for a, b in
                                         zip(ref, got, strict=True)),
                     "scale": max(float(a.abs().max()) for a in ref), "slow_bytes": nbytes}
    if dist.get_rank() == 0:
        res["n_params"] = sum(p.numel() for p in model().parameters())
        with open(sys.argv[1], "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
