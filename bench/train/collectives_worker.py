"""One rank of bench/train/collectives.py, started inside an emulated node's namespace.

Runs, one after another in this process group, the requested variants on the same
model and data: ``local`` / ``local_end`` (no communication: the compute reference, at
both ends of a launch), ``flat`` (DDP
ring all-reduce), ``hier`` (DDP hierarchical hook), ``hier_topk`` (hierarchical with
top-k + error feedback on the inter-node hop), ``fsdp`` (FSDP2 over all ranks) and
``hsdp`` (FSDP2 sharded in the node, replicated across). Per step it records this
rank's step time and, on each node's first rank, the byte counters of the node's
inter-node link; barriers outside the timed region line steps up. With ``--calib``
it first times, at several sizes, all-reduces between two ranks on different nodes
(the slow link) and inside a node (the fast path), one pair at a time, then each
collective of ``--calib-phases`` on every group of its level at once, the hook's
buffer passes and the top-k selection, for the α-β fit. Rank 0 writes
everything as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from convergent.train.compression import CommStats, register_compression, topk_payload, topk_sum
from convergent.train.hierarchy import discover_tiers, register_hierarchical


def counters() -> tuple[int, int] | None:
    dev = os.environ.get("CONVERGENT_NETEMU_DEV")
    if not dev or os.environ.get("LOCAL_RANK") != "0":
        return None
    base = f"/sys/class/net/{dev}/statistics/"
    with open(base + "tx_bytes") as f, open(base + "rx_bytes") as g:
        return int(f.read()), int(g.read())


class Block(nn.Module):
    """Residual MLP block (one FSDP unit)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.gelu(self.lin(x))


def build(dim: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(dim) for _ in range(layers - 1)], nn.Linear(dim, dim))


def batch(dim: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Regression onto a fixed random linear teacher (learnable in a few steps)."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.Generator().manual_seed(1234)
    w = torch.randn(dim, dim, generator=teacher) / dim**0.5
    x = torch.randn(n, dim, generator=g)
    return x, x @ w


def _timed(run: bool, fn, reps: int) -> float:  # noqa: ANN001
    """Median over ``reps`` (after one warm-up) of the slowest rank's seconds for ``fn``,
    run by the ranks with ``run`` set while the others wait at the next barrier."""
    ts = []
    for _ in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if run:
            fn()
        ts.append(time.perf_counter() - t0 if run else None)
    allv: list = [None] * dist.get_world_size()
    dist.all_gather_object(allv, ts[1:])  # the first repetition warms the connections
    return statistics.median(max(v[i] for v in allv if v[i] is not None) for i in range(reps))


def _collective(kind: str, full: torch.Tensor, part: torch.Tensor, pg) -> None:  # noqa: ANN001
    """One collective issued as DDP's hooks and FSDP2 issue theirs: asynchronously (gloo
    runs it on its own thread), then waited for."""
    if kind == "ar":
        work = dist.all_reduce(full, group=pg, async_op=True)
    elif kind == "rs":
        work = dist.reduce_scatter_tensor(part, full, group=pg, async_op=True)
    else:
        work = dist.all_gather_into_tensor(full, part, group=pg, async_op=True)
    work.wait()


def level_groups(nodes: list[list[int]]) -> dict:
    """This rank's process group and its size per level: ``world`` (the default group),
    ``intra`` (its node), ``cross`` (the ranks of its local rank on every node). Every
    rank creates every group, in the same order."""
    rank = dist.get_rank()
    L = len(nodes[0])
    groups = {"intra": nodes, "cross": [[n[i] for n in nodes] for i in range(L)]}
    mine: dict = {"world": (None, dist.get_world_size())}
    for level, gs in groups.items():
        for g in gs:
            pg = dist.new_group(sorted(g))
            if rank in g:
                mine[level] = (pg, len(g))
    return mine


def calibrate(nodes: list[list[int]], mine: dict, sizes: list[int], reps: int,
              phases: list[str]) -> dict:
    """Median seconds per size of (a) a 2-rank all-reduce across nodes (``slow``) and
    inside one node (``fast``), one pair at a time: the raw link figures; (b) each
    ``phase`` ``<level>_<collective>`` with every group of that level running it at once,
    as the variants do (``world``: all ranks; ``intra``: one group per node; ``cross``:
    one group per local rank, its ranks on different nodes; ``ar`` all-reduce, ``rs``
    reduce-scatter of ``size`` bytes in, ``ag`` all-gather of ``size`` bytes out);
    (c) ``copy``: the hierarchical hook's local passes over a bucket (copy in, scale,
    copy back; its work buffers are kept across steps) on every rank at once."""
    rank = dist.get_rank()
    pairs = {"slow": [nodes[0][0], nodes[1][0]], "fast": nodes[0][:2]}
    pair_groups = {k: dist.new_group(sorted(v)) for k, v in pairs.items()}
    out: dict = {}
    for level, members in pairs.items():
        out[level] = {}
        for size in sizes:
            buf = torch.ones(size // 4)
            out[level][str(size)] = _timed(
                rank in members, lambda b=buf, g=pair_groups[level]: dist.all_reduce(b, group=g),
                reps)
    for phase in phases:
        level, kind = phase.split("_")
        pg, p = mine[level]
        out[phase] = {}
        for size in sizes:
            n = size // 4 // p * p
            out[phase][str(size)] = _timed(
                True, partial(_collective, kind, torch.ones(n), torch.ones(n // p), pg), reps)
    out["copy"] = {}
    for size in sizes:
        src, pad = torch.ones(size // 4), torch.zeros(size // 4)

        def work(src: torch.Tensor = src, pad: torch.Tensor = pad) -> None:
            pad.copy_(src)
            pad.div_(4)
            src.copy_(pad)

        out["copy"][str(size)] = _timed(True, work, reps)
    return out


def topk_compute(n: int, ratio: float, groups: int, reps: int = 5) -> float:
    """Seconds of the hierarchical top-k hook's local work on an ``n``-element shard, on
    every rank at once (slowest rank, median over ``reps``): the same error-feedback
    selection and dense rebuild of ``groups`` payloads as the hook (the γ term)."""
    shard, residuals = torch.randn(n), {0: torch.randn(n) * 0.01}

    def work() -> None:
        payload, k = topk_payload(shard, residuals, 0, ratio)
        shard.copy_(topk_sum([payload] * groups, k, n, shard.device))

    return _timed(True, work, reps)


def sync_cost(dim: int, layers: int, batch_n: int, groups: dict, reps: int = 12) -> dict:
    """Per level (``world``, ``intra``, ``cross``): what joining one 4-byte all-reduce of
    that level right after backward adds to a training step of the benchmark model (no
    gradient bytes move): on an oversubscribed CPU the ranks stop overlapping their
    compute at a synchronisation point (the optimizer steps run all at once afterwards,
    ranks wait to be scheduled). Median over ``reps`` of the slowest rank's step minus the
    slowest rank's plain step run just before it (paired, as the variants are)."""
    model = build(dim, layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x, y = batch(dim, batch_n, 7)
    tiny = torch.ones(1)
    out = {}
    for level, pg in groups.items():
        diffs = []
        for i in range(reps + 2):
            times = []
            for sync in (False, True):
                dist.barrier()
                t0 = time.perf_counter()
                nn.functional.mse_loss(model(x), y).backward()
                if sync:
                    dist.all_reduce(tiny, group=pg)
                opt.step()
                opt.zero_grad(set_to_none=True)
                times.append(time.perf_counter() - t0)
            allv: list = [None] * dist.get_world_size()
            dist.all_gather_object(allv, times)
            if i >= 2:  # two warm-up pairs
                diffs.append(max(v[1] for v in allv) - max(v[0] for v in allv))
        out[level] = statistics.median(diffs)
    return out


def wrap(variant: str, dim: int, layers: int, tiers, meshes: dict, ratio: float):  # noqa: ANN001, ANN201
    """Model prepared for ``variant`` and the module to call."""
    model = build(dim, layers)
    if variant.startswith("local"):  # local, local_end: no communication
        return model, model
    if variant in ("flat", "hier", "hier_topk"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, bucket_cap_mb=1000, broadcast_buffers=False)  # one bucket
        stats = CommStats()
        pcfg = SimpleNamespace(compression="topk" if variant == "hier_topk" else "none",
                               topk_ratio=ratio, powersgd_rank=2, powersgd_start_iter=10)
        if variant == "flat":
            register_compression(ddp, "none", pcfg, stats)
        else:
            register_hierarchical(ddp, pcfg, stats, tiers)
        return model, ddp
    from torch.distributed.fsdp import fully_shard

    mesh = meshes[variant]
    for blk in model:
        fully_shard(blk, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model, model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--topk-ratio", type=float, default=0.01)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--calib", default="")  # comma-separated byte sizes
    ap.add_argument("--calib-phases", default="")  # comma-separated <level>_<collective>
    ap.add_argument("--eval-at", default="")  # comma-separated step counts: eval loss there too
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pcfg = SimpleNamespace(topology_file=None, topology_level="node")
    tiers = discover_tiers(pcfg, world)
    nodes = tiers.nodes
    from torch.distributed.device_mesh import DeviceMesh

    meshes = {"fsdp": DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("shard",)),
              "hsdp": DeviceMesh("cpu", torch.tensor(nodes),
                                 mesh_dim_names=("replicate", "shard"))}
    result: dict = {"nodes": nodes, "world": world, "variants": {}}
    if args.calib:
        mine = level_groups(nodes)
        result["calibration"] = calibrate(nodes, mine, [int(s) for s in args.calib.split(",")], 5,
                                          [p for p in args.calib_phases.split(",") if p])
        n = sum(p.numel() for p in build(args.dim, args.layers).parameters())
        result["calibration"]["sync_s"] = sync_cost(args.dim, args.layers, args.batch,
                                                    {lv: pg for lv, (pg, _) in mine.items()})
        result["calibration"]["topk_compute_s"] = topk_compute(
            n // len(nodes[0]), args.topk_ratio, groups=len(nodes))
    eval_x, eval_y = batch(args.dim, 256, 999_999)
    for variant in args.variants.split(","):
        model, fwd = wrap(variant, args.dim, args.layers, tiers, meshes, args.topk_ratio)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        # the compute reference, paired: a no-communication step of the same model right
        # before each timed step (same moment, same load), so drift between the ends of a
        # launch does not enter the communication time
        # (not in the loss-check launch, ``--eval-at``, which times nothing)
        paired = not variant.startswith("local") and not args.eval_at
        ref = build(args.dim, args.layers) if paired else None
        ref_opt = torch.optim.SGD(ref.parameters(), lr=args.lr, momentum=0.9) if ref else None
        steps = []
        evals: dict[str, float] = {}
        eval_at = {int(x) for x in args.eval_at.split(",") if x}
        for step in range(args.warmup + args.steps):
            x, y = batch(args.dim, args.batch, 1000 * step + rank)
            ref_dt = None
            if ref is not None:
                dist.barrier()
                t0 = time.perf_counter()
                nn.functional.mse_loss(ref(x), y).backward()
                ref_opt.step()
                ref_opt.zero_grad(set_to_none=True)
                ref_dt = time.perf_counter() - t0
            dist.barrier()
            c0 = counters()
            t0 = time.perf_counter()
            loss = nn.functional.mse_loss(fwd(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            dist.barrier()
            c1 = counters()
            steps.append({"s": dt, "ref_s": ref_dt, "loss": float(loss),
                          "tx": c1[0] - c0[0] if c1 else None,
                          "rx": c1[1] - c0[1] if c1 else None})
            if step + 1 in eval_at:  # outside the timed region
                with torch.no_grad():
                    evals[str(step + 1)] = float(nn.functional.mse_loss(fwd(eval_x), eval_y))
        with torch.no_grad():
            ev = float(nn.functional.mse_loss(fwd(eval_x), eval_y))
        allv: list = [None] * world
        dist.all_gather_object(allv, {"steps": steps, "eval_loss": ev, "evals": evals,
                                      "node": int(os.environ.get("GROUP_RANK", "0")),
                                      "local_rank": int(os.environ.get("LOCAL_RANK", "0"))})
        result["variants"][variant] = allv
        del model, fwd, opt
    result["units_bytes"] = [4 * sum(p.numel() for p in blk.parameters())
                             for blk in build(args.dim, args.layers)]
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
