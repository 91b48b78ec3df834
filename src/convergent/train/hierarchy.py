"""Topology-aware (hierarchical) gradient all-reduce as a DDP communication hook.

``parallel.allreduce``:

* ``flat``         — one all-reduce over every rank (ring order = rank order), the
  compression of :mod:`convergent.train.compression` applied to all of it;
* ``hierarchical`` — per gradient bucket: reduce-scatter inside the node (fast links),
  all-reduce of this rank's shard across nodes with the ranks holding the same shard
  (one rank per node: the slow links carry ``1/L`` of the bucket per rank, ``L`` ranks
  per node), then all-gather inside the node. With a rack map (``topology_level:
  rack``) there is a third tier: reduce-scatter in the node, reduce-scatter across the
  nodes of a rack, all-reduce across racks, then the two all-gathers back.
  ``parallel.compression`` applies to the outermost (slowest) hop only; the inner
  hops stay exact: ``fp16`` casts the shard, ``topk`` sparsifies it with error
  feedback (residual per bucket shard), ``powersgd`` (two tiers only) all-reduces the
  bucket exactly inside the node and runs PyTorch's PowerSGD among one leader per node,
  which broadcasts the result back inside its node;
* ``auto``         — hierarchical when the node map has more than one node and more
  than one rank per node, else flat.

Node groups: ``parallel.topology_file`` with explicit ``groups`` (rank lists, one per
node), else one group per node key, all-gathered from every rank: the node name
(``SLURMD_NODENAME`` or the hostname, :func:`convergent.train.topology.node_name`) plus
torchrun's node rank ``GROUP_RANK`` when set (so several emulated nodes on one host,
and any multi-node torchrun launch, are told apart). Ranks of a node need not be
contiguous (a scheduler's scattered placement works; the hook follows the map).

The hook runs its collectives synchronously on the training thread and returns a
completed future: gloo pairs collectives by issue order per group, and issuing the
later hops from future callbacks (while the main thread issues the next bucket's
first hop) could interleave them differently on different ranks. The cost is that a
bucket's communication no longer overlaps the rest of backward.

``CommStats.bytes`` counts the payload this rank sends on the outermost hop (the slow
links), so ``comm_bytes`` in the metrics is per-rank slow-link payload for this
algorithm; the wire bytes per link are measured by ``bench/train/collectives.py``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from convergent.core.errors import ConfigError
from convergent.train.compression import instrument, powersgd_bytes, topk_payload, topk_sum
from convergent.train.topology import _host_to_rack, node_name, read_topology_file

if TYPE_CHECKING:
    from convergent.train.config import ParallelConfig


@dataclass(frozen=True)
class Tiers:
    """The rank layout: ``racks[r][n][l]`` is the global rank of local rank ``l`` on
    node ``n`` of rack ``r`` (one rack holding every node when no rack map is given)."""

    racks: list[list[list[int]]]

    @property
    def nodes(self) -> list[list[int]]:
        return [node for rack in self.racks for node in rack]

    def levels(self) -> list[list[list[int]]]:
        """Groups per hop, innermost first; hops of size 1 are dropped."""
        racks = self.racks
        nl, N, R = len(racks[0][0]), len(racks[0]), len(racks)
        intra = [racks[r][n] for r in range(R) for n in range(N)]
        rack = [[racks[r][n][i] for n in range(N)] for r in range(R) for i in range(nl)]
        cross = [[racks[r][n][i] for r in range(R)] for n in range(N) for i in range(nl)]
        return [lvl for lvl in (intra, rack, cross) if len(lvl[0]) > 1]


def node_key() -> str:
    """This process's node identity: :func:`~convergent.train.topology.node_name` (Slurm's
    node name, else the hostname), plus torchrun's node rank when set."""
    host = node_name()
    gr = os.environ.get("GROUP_RANK")
    return f"{host}#{gr}" if gr is not None else host


def build_tiers(
    node_of: list[str] | list[int],
    rack_of_node: dict[Any, str] | None = None,
    groups: list[list[int]] | None = None,
) -> Tiers:
    """Tiers from per-rank node keys (or explicit node ``groups``) and a rack map."""
    world = len(node_of)
    if groups is not None:
        nodes = [[int(r) for r in g] for g in groups]
        if sorted(r for g in nodes for r in g) != list(range(world)):
            raise ConfigError(
                f"topology 'groups' must list every rank 0..{world - 1} exactly once"
            )
        keys: list[Any] = list(range(len(nodes)))
    else:
        by: dict[Any, list[int]] = {}
        for r, k in enumerate(node_of):
            by.setdefault(k, []).append(r)
        keys, nodes = list(by), list(by.values())
    if len({len(n) for n in nodes}) != 1:
        raise ConfigError(
            f"parallel.allreduce=hierarchical needs equal ranks per node, got "
            f"{sorted(len(n) for n in nodes)}",
            hint="use parallel.allreduce=flat or fix the topology file",
        )
    if not rack_of_node:
        return Tiers([nodes])
    racks: dict[str, list[list[int]]] = {}
    for k, n in zip(keys, nodes, strict=True):
        racks.setdefault(rack_of_node.get(k, str(k)), []).append(n)
    if len({len(r) for r in racks.values()}) != 1:
        raise ConfigError(
            f"parallel.allreduce=hierarchical needs equal nodes per rack, got "
            f"{sorted(len(r) for r in racks.values())}",
            hint="fix the rack map in parallel.topology_file or use topology_level: node",
        )
    return Tiers(list(racks.values()))


def discover_tiers(pcfg: ParallelConfig, world: int) -> Tiers:
    """Tiers for this job (collective: every rank must call it)."""
    topo = read_topology_file(pcfg.topology_file) if pcfg.topology_file else {}
    keys: list[Any] = [None] * world
    dist.all_gather_object(keys, node_key())
    rack_map = None
    if pcfg.topology_level == "rack" and topo:
        h2r = _host_to_rack(topo)
        rack_map = {k: h2r.get(str(k).split("#")[0], str(k)) for k in keys}
    return build_tiers(keys, rack_map, topo.get("groups"))


def choose_algorithm(setting: str, tiers: Tiers) -> str:
    """``auto``: hierarchical when there are several nodes of several ranks each."""
    if setting != "auto":
        return setting
    nodes = tiers.nodes
    return "hierarchical" if len(nodes) > 1 and len(nodes[0]) > 1 else "flat"


@dataclass
class HierState:
    """State of the hierarchical hook: this rank's group per hop and compression."""

    groups: list[Any]  # process group per hop, innermost first (the last is the slow hop)
    sizes: list[int]
    compression: str = "none"
    topk_ratio: float = 0.01
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    powersgd: Any = None  # PowerSGDState on node leaders
    leader: bool = False
    leader_src: int = 0  # global rank of this node's leader
    slow_bytes: int = 0  # payload bytes this rank put on the slow hop, last bucket
    scratch: dict[int, torch.Tensor] = field(default_factory=dict)  # per hop, reused

    def buffer(self, hop: int, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A ``numel``-element work buffer for ``hop``, kept across buckets and steps (the
        hook is synchronous, so one per hop serves every bucket): fresh multi-MB
        allocations each step cost page faults the collectives then pay for."""
        t = self.scratch.get(hop)
        if t is None or t.numel() < numel or t.dtype != like.dtype or t.device != like.device:
            t = torch.empty(numel, dtype=like.dtype, device=like.device)
            self.scratch[hop] = t
        return t[:numel]

    def state_dict(self) -> dict[str, Any]:
        """Top-k residuals by bucket index (restored when the shapes still match)."""
        return {"kind": f"hier-{self.compression}",
                "residual": {k: v.cpu() for k, v in self.residuals.items()}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("kind") == f"hier-{self.compression}":
            self.residuals = {int(k): v for k, v in sd.get("residual", {}).items()}


def make_state(tiers: Tiers, rank: int, pcfg: ParallelConfig) -> HierState:
    """Create every hop's process groups (collective) and this rank's hook state."""
    groups, sizes = [], []
    for level in tiers.levels():
        mine = None
        for ranks in level:
            g = dist.new_group(sorted(ranks))
            if rank in ranks:
                mine = g
        groups.append(mine)
        sizes.append(len(level[0]))
    st = HierState(groups, sizes, pcfg.compression, pcfg.topk_ratio)
    if pcfg.compression == "powersgd":
        if len(tiers.racks) > 1:
            raise ConfigError(
                "parallel.compression=powersgd with allreduce=hierarchical supports two "
                "tiers (node, cross-node) only", hint="use topology_level: node",
            )
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        node = next(n for n in tiers.nodes if rank in n)
        leaders = [n[0] for n in tiers.nodes]
        lg = dist.new_group(sorted(leaders))
        st.leader, st.leader_src = rank == node[0], node[0]
        st.powersgd = powerSGD_hook.PowerSGDState(
            process_group=lg, matrix_approximation_rank=pcfg.powersgd_rank,
            start_powerSGD_iter=max(2, pcfg.powersgd_start_iter), use_error_feedback=True,
            warm_start=True, random_seed=0,
        )
    return st


def _slow_allreduce(st: HierState, shard: torch.Tensor, key: int) -> torch.Tensor:
    """Sum ``shard`` over the slow hop's group, compressed as configured (in place)."""
    group = st.groups[-1]
    size = st.sizes[-1]
    if st.compression == "fp16":
        half = shard.to(torch.float16)
        st.slow_bytes += half.numel() * 2
        dist.all_reduce(half, group=group)
        shard.copy_(half)
        return shard
    if st.compression == "topk":
        payload, k = topk_payload(shard, st.residuals, key, st.topk_ratio)
        gathered = [torch.empty_like(payload) for _ in range(size)]
        st.slow_bytes += payload.numel() * 4
        dist.all_gather(gathered, payload, group=group)
        shard.copy_(topk_sum(gathered, k, shard.numel(), shard.device).to(shard.dtype))
        return shard
    st.slow_bytes += shard.numel() * shard.element_size()
    dist.all_reduce(shard, group=group)
    return shard


def _powersgd(st: HierState, bucket: Any) -> torch.Tensor:
    """Exact node all-reduce, PowerSGD among node leaders, broadcast in the node."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    buf = bucket.buffer()
    node = st.groups[0] if len(st.groups) > 1 else None
    if node is not None:
        dist.all_reduce(buf, group=node)
        buf.div_(st.sizes[0])  # node mean; PowerSGD averages over the leaders
    if st.leader:
        st.slow_bytes += powersgd_bytes(bucket, st.powersgd)
        buf.copy_(powerSGD_hook.powerSGD_hook(st.powersgd, bucket).wait())
    if node is not None:
        dist.broadcast(buf, src=st.leader_src, group=node)
    return buf


def hierarchical_hook(state, bucket):  # noqa: ANN001 - DDP checks annotations, keep none
    """DDP comm hook: reduce-scatter inward, all-reduce on the slow hop, all-gather out."""
    st: HierState = state
    buf = bucket.buffer()
    world = math.prod(st.sizes)
    if st.compression == "powersgd":
        out = _powersgd(st, bucket)
    else:
        inner = list(zip(st.groups[:-1], st.sizes[:-1], strict=True))
        shards = math.prod(s for _, s in inner)
        n = buf.numel()
        padded = st.buffer(0, -(-n // shards) * shards, buf)
        padded[n:].zero_()
        padded[:n].copy_(buf)
        padded.div_(world)
        cur = padded
        for hop, (g, s) in enumerate(inner, 1):  # reduce-scatter toward the slow hop
            part = st.buffer(hop, cur.numel() // s, cur)
            dist.reduce_scatter_tensor(part, cur, group=g)
            cur = part
        _slow_allreduce(st, cur, bucket.index())
        for hop in reversed(range(len(inner))):  # all-gather back out into the hop's input
            g, s = inner[hop]
            whole = st.buffer(hop, cur.numel() * s, cur)
            dist.all_gather_into_tensor(whole, cur, group=g)
            cur = whole
        buf.copy_(cur[:n])
        out = buf
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(out)
    return fut


def register_hierarchical(ddp_model: Any, pcfg: ParallelConfig, stats: Any, tiers: Tiers) -> HierState:
    """Register the hierarchical hook on a DDP model, counting slow-hop bytes."""
    st = make_state(tiers, dist.get_rank(), pcfg)

    def before(s: HierState, _bucket: Any) -> None:
        s.slow_bytes = 0

    def run(s, bucket):  # noqa: ANN001 - DDP checks annotations, keep none
        fut = hierarchical_hook(s, bucket)
        stats.bytes += s.slow_bytes
        return fut

    ddp_model.register_comm_hook(st, instrument(run, stats, lambda *_: 0, before))
    return st


def plan_record(algorithm: str, tiers: Tiers, pcfg: ParallelConfig) -> dict[str, Any]:
    """The metrics record naming the gradient all-reduce algorithm chosen for the run."""
    return {
        "kind": "comm_algorithm",
        "allreduce": algorithm,
        "setting": pcfg.allreduce,
        "compression": pcfg.compression,
        "compressed_hop": "slow" if algorithm == "hierarchical" else "all",
        "nodes": tiers.nodes,
        "racks": len(tiers.racks),
        "hops": [len(lvl[0]) for lvl in tiers.levels()] if algorithm == "hierarchical" else [],
    }
