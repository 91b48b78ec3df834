"""α-β (latency-bandwidth) cost model of gradient collectives on a two- or three-level
network: time and bytes leaving a node for flat ring, tree, hierarchical and compressed
all-reduce, and for FSDP / HSDP steps.

A message of ``b`` bytes over a link costs ``alpha + b * beta``. Collectives proceed in
synchronous steps; a step lasts as long as its slowest link, and ``flows`` concurrent
messages leaving through one node's egress share its bandwidth (the emulated network
has one veth per node; a DGX-style node has one NIC per GPU, ``shared_egress=False``).

Ring all-reduce of ``S`` bytes over ``P`` ranks: ``2(P-1)`` steps of ``S/P`` bytes each,
so each ring edge carries ``2(P-1)/P * S``. With node-contiguous ranks one ring edge
leaves each node; with a scattered placement (ranks dealt round-robin over nodes)
every edge crosses, ``L`` of them leave each node. Hierarchical (``L`` ranks per node,
``N`` nodes): reduce-scatter in the node (``(L-1)`` fast steps of ``S/L``), ``L``
concurrent ring all-reduces of ``S/L`` across nodes (``2(N-1)`` steps, ``S/N`` bytes
through each node's egress per step), all-gather in the node: ``2(N-1)/N * S`` bytes
leave a node against the flat ring's ``2(P-1)/P * S`` (2/3 of it for 2 x 2). Top-k on the
slow hop sends ``8k`` bytes (value, index) per rank with a ring all-gather over ``N``:
``(N-1) * L * 8k`` leave a node. Binary-tree all-reduce (reduce then broadcast,
pipelined as NCCL's double tree): ``2 log2(P)`` latency terms and ``2 S`` bandwidth.
FSDP per unit of ``s`` bytes: all-gather in forward, again in backward when resharded,
reduce-scatter of gradients, each ``(P-1)`` ring steps of ``s/P``; HSDP shards inside
the node and all-reduces the ``s/L`` gradient shards across nodes.

Measured phases. On a real fabric each link level is a resource of its own; on the
emulation four gloo ranks share two CPU cores, so a step's cost also depends on what the
other ranks do meanwhile (both nodes reduce-scattering at once, two cross-node pairs
sharing the veth, the kernel forwarding between namespaces). ``Net.measured`` holds, per
phase ``<level>_<collective>`` (levels ``world`` / ``intra`` / ``cross``, collectives
``ar`` all-reduce, ``rs`` reduce-scatter, ``ag`` all-gather), an α-β pair per ring step
fitted from a calibration that runs that collective on every group of the level at once
(:func:`fit_phase`); a phase found there replaces the link-level term (its flows and
sharing are in the measurement), the rest fall back to ``fast`` / ``slow``. ``copy_beta``
(s/byte) prices local passes over a bucket: the hierarchical hook's (copy in, scale, copy
back: :data:`HOOK_PASSES`) and DDP's own (:func:`local_passes`); :func:`burst_saving`
takes off what a token-bucket shaper's refilled bucket lets through at line rate. A
measured phase may be :class:`Regimes` (α-β per message-size range, ``fit_phase(...,
weight="regimes")``). ``Net.sync`` prices a synchronisation point after compute per level
(:func:`sync_points`): with more ranks than cores, ranks that computed interleaved line
up at a collective and what follows runs on all of them at once.

Variants for the converged-computing ideas: ``overlap`` (the fraction of communication
hidden behind backward compute: sync-free notification lets buckets go as soon as
ready) and ``isolation`` (``contention`` jobs sharing the slow links; a reconfigurable
network that isolates the job's links sets it to 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

LEVELS = ("world", "intra", "cross")
COLLECTIVES = ("ar", "rs", "ag")
HOOK_PASSES = 3  # copy in, scale, copy back: the hierarchical hook's passes over a bucket
DDP_PASSES = 2  # DDP copies gradients into its bucket and back (no gradient_as_bucket_view)


@dataclass(frozen=True)
class Link:
    """Per-message latency ``alpha`` (s) and inverse bandwidth ``beta`` (s/byte)."""

    alpha: float
    beta: float

    def t(self, nbytes: float, flows: int = 1) -> float:
        return self.alpha + flows * nbytes * self.beta


@dataclass(frozen=True)
class Regimes:
    """α-β per message-size regime: segment ``i`` holds from ``bounds[i]`` bytes up
    (the first also below, the last also above); each an α-β pair through two adjacent
    calibration sizes. A token-bucket shaper lets small messages through at line rate
    from its bucket and large ones at the shaped rate, and gloo's per-message cost on a
    shared CPU is not one constant, so one α-β line over 64 KiB-4 MiB misprices both
    ends; NCCL's own tuner likewise keeps α-β per protocol and size range.
    ``alpha`` / ``beta``: the largest-size regime's (the bandwidth figure reported)."""

    bounds: tuple[float, ...]
    links: tuple[Link, ...]

    @property
    def alpha(self) -> float:
        return self.links[-1].alpha

    @property
    def beta(self) -> float:
        return self.links[-1].beta

    def t(self, nbytes: float, flows: int = 1) -> float:
        i = max(0, min(len(self.links) - 1,
                       sum(1 for b in self.bounds[1:] if flows * nbytes >= b)))
        return self.links[i].t(nbytes, flows)


@dataclass(frozen=True)
class Net:
    """``nodes`` x ``per_node`` ranks; ``fast`` links inside a node, ``slow`` between."""

    nodes: int
    per_node: int
    fast: Link
    slow: Link
    shared_egress: bool = True  # one egress per node (emulation) vs one NIC per rank
    contention: float = 1.0  # jobs sharing the slow links (1: isolated)
    measured: dict[str, Link | Regimes] = field(default_factory=dict, compare=False)  # per phase
    copy_beta: float = 0.0  # s/byte of local buffer work in the hierarchical hook
    # s per synchronisation point after compute, per level (measured; 0 on a dedicated
    # core per rank, where ranks compute in lockstep anyway): :func:`sync_points`
    sync: dict[str, float] = field(default_factory=dict, compare=False)

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    def group(self, level: str) -> int:
        """Ranks in one group of ``level``."""
        return {"world": self.world, "intra": self.per_node, "cross": self.nodes}[level]

    def slow_t(self, nbytes: float, flows: int) -> float:
        f = flows if self.shared_egress else 1
        return self.slow.alpha + f * nbytes * self.slow.beta * self.contention


@dataclass(frozen=True)
class Cost:
    """Predicted communication time (s) and bytes leaving one node per operation."""

    seconds: float
    node_out_bytes: float

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.seconds + other.seconds, self.node_out_bytes + other.node_out_bytes)

    def scale(self, k: float) -> Cost:
        return Cost(self.seconds * k, self.node_out_bytes * k)


def ring_steps(kind: str, p: int) -> int:
    """Ring steps of collective ``kind`` over ``p`` ranks; each moves ``size / p`` bytes
    per rank (``size``: the all-reduced tensor, the reduce-scatter's input, the
    all-gather's output)."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r} (one of {COLLECTIVES})")
    return 2 * (p - 1) if kind == "ar" else p - 1


def collective(net: Net, level: str, kind: str, size: float, flows: int = 1) -> float:
    """Seconds of one ``kind`` collective of ``size`` bytes on every group of ``level``
    at once: the measured phase when calibrated, else ring steps on the level's link
    (``flows`` of a node's ranks sharing its egress on the slow links)."""
    p = net.group(level)
    if p <= 1:
        return 0.0
    steps, chunk = ring_steps(kind, p), size / p
    link = net.measured.get(f"{level}_{kind}")
    if link is not None:
        return steps * link.t(chunk)
    if level == "intra" or (level == "world" and net.nodes == 1):
        return steps * net.fast.t(chunk)
    return steps * net.slow_t(chunk, flows)


def flat_ring(net: Net, size: float, scattered: bool = False) -> Cost:
    """Ring all-reduce over every rank in rank order."""
    p = net.world
    if p == 1:
        return Cost(0.0, 0.0)
    crossing = net.per_node if scattered else 1  # ring edges leaving one node
    steps = 2 * (p - 1)
    out = 0.0 if net.nodes == 1 else crossing * steps * size / p
    return Cost(collective(net, "world", "ar", size, crossing), out)


def tree(net: Net, size: float) -> Cost:
    """Pipelined binary-tree all-reduce (reduce + broadcast) over every rank."""
    p = net.world
    if p == 1:
        return Cost(0.0, 0.0)
    lat = 2 * math.ceil(math.log2(p)) * net.slow.alpha
    return Cost(lat + 2 * size * net.slow.beta * net.contention, 2 * size)


def _inner(net: Net, size: float) -> float:
    """The hierarchical hook's node part: reduce-scatter of ``size`` bytes in the node,
    all-gather back, and its local passes over the bucket."""
    return (collective(net, "intra", "rs", size) + collective(net, "intra", "ag", size)
            + HOOK_PASSES * size * net.copy_beta)


def hierarchical(net: Net, size: float, slow_fraction: float = 1.0) -> Cost:
    """Reduce-scatter in node, ring all-reduce across nodes, all-gather in node.

    ``slow_fraction`` scales the slow-hop payload (fp16: 0.5; dense compressors)."""
    n, L = net.nodes, net.per_node
    inner = _inner(net, size)
    if n == 1:
        return Cost(inner, 0.0)
    shard = size / L * slow_fraction
    steps = 2 * (n - 1)
    t = collective(net, "cross", "ar", shard, L)
    return Cost(inner + t, L * steps * shard / n)


def hierarchical_topk(net: Net, size: float, ratio: float, elem: int = 4) -> Cost:
    """Hierarchical with top-k (value + int32 index) all-gather on the slow hop."""
    n, L = net.nodes, net.per_node
    inner = _inner(net, size)
    k = max(1, math.ceil(ratio * size / elem / L))
    payload = 8 * k
    if n == 1:
        return Cost(inner, 0.0)
    t = collective(net, "cross", "ag", n * payload, L)
    return Cost(inner + t, (n - 1) * L * payload)


def fsdp(
    net: Net, units: list[float], reshard: list[bool], rs_allreduce: bool = False
) -> Cost:
    """FSDP over every rank: ring all-gathers (forward; backward when resharded) and a
    gradient reduce-scatter per unit; ``rs_allreduce``: the backend implements the
    reduce-scatter as a full all-reduce (gloo does: ``2(P-1)`` steps, measured)."""
    p = net.world
    total = Cost(0.0, 0.0)
    # a measured reduce-scatter already is whatever the backend does
    rs_kind = "ar" if rs_allreduce and "world_rs" not in net.measured else "rs"
    for s, rs in zip(units, reshard, strict=True):
        steps = (2 if rs else 1) * (p - 1) + (2 if rs_allreduce else 1) * (p - 1)
        out = 0.0 if net.nodes == 1 else steps * s / p
        t = (2 if rs else 1) * collective(net, "world", "ag", s) \
            + collective(net, "world", rs_kind, s)
        total += Cost(t, out)
    return total


def hsdp(net: Net, units: list[float], reshard: list[bool]) -> Cost:
    """HSDP: shard inside the node, all-reduce gradient shards across nodes."""
    total = Cost(0.0, 0.0)
    n, L = net.nodes, net.per_node
    for s, rs in zip(units, reshard, strict=True):
        t = (2 if rs else 1) * collective(net, "intra", "ag", s) \
            + collective(net, "intra", "rs", s) + collective(net, "cross", "ar", s / L, L)
        total += Cost(t, 2 * (n - 1) * s / n if n > 1 else 0.0)
    return total


def local_passes(net: Net, size: float, passes: int) -> Cost:
    """``passes`` local passes over ``size`` bytes at ``copy_beta`` (DDP's bucket copies:
    :data:`DDP_PASSES`, plus the flat hook's scaling pass)."""
    return Cost(passes * size * net.copy_beta, 0.0)


def sync_points(net: Net, level: str, count: int) -> Cost:
    """``count`` collectives of ``level`` that each wait for every rank of their group to
    finish compute: on an oversubscribed CPU ranks that computed interleaved must line
    up there, and what follows (the optimizer step, the next unit) runs on every rank at
    once; ``net.sync[level]`` is that cost per point, measured (a 4-byte collective
    after backward, against the same step without it)."""
    return Cost(count * net.sync.get(level, 0.0), 0.0)


def burst_saving(net: Net, first_egress_bytes: float, credit: float) -> Cost:
    """A token-bucket shaper (``tc tbf``) that has been idle lets up to its bucket
    (``credit`` bytes, at most the configured burst) leave at line rate: the first
    ``min(credit, first_egress_bytes)`` bytes a step pushes through a node's egress skip
    the slow link's ``beta`` (one flow's s/byte: the shaped rate)."""
    return Cost(-min(max(credit, 0.0), first_egress_bytes) * net.slow.beta, 0.0)


def exposed(cost: Cost, backward_s: float, overlap: float) -> float:
    """Communication left on the critical path when ``overlap`` (0..1) of it can hide
    behind ``backward_s`` of backward compute (sync-free bucket launch)."""
    hidden = min(cost.seconds * overlap, backward_s)
    return cost.seconds - hidden


def fit_phase(phase: str, group: int, sizes: list[float], seconds: list[float],
              weight: str = "relative") -> Link:
    """α-β per ring step of ``phase`` (``<level>_<collective>``) on groups of ``group``
    ranks, from its calibration timings (``sizes`` as :func:`ring_steps` defines them)."""
    kind = phase.split("_")[-1]
    if weight == "regimes":
        return fit_regimes(sizes, seconds, ring_steps(kind, group), 1 / group)
    return fit_link(sizes, seconds, ring_steps(kind, group), 1 / group, weight)


def fit_regimes(sizes: list[float], seconds: list[float], steps: int,
                per_step: float) -> Regimes:
    """:class:`Regimes` through each pair of adjacent calibration sizes (sorted; α, β
    clamped at 0 as in :func:`fit_link`; a segment whose two timings fall with size gets
    β = 0 and the mean as α)."""
    pts = sorted(zip(sizes, seconds, strict=True))
    if len(pts) < 2:
        raise ValueError("a regime fit needs timings at two sizes or more")
    links = []
    for (s0, t0), (s1, t1) in zip(pts, pts[1:], strict=False):
        links.append(fit_link([s0, s1], [t0, t1], steps, per_step, "absolute"))
    return Regimes(tuple(per_step * s for s, _ in pts[:-1]), tuple(links))


def fit_link(sizes: list[float], seconds: list[float], steps: int, per_step: float,
             weight: str = "relative") -> Link:
    """α, β from timings of a collective with ``steps`` latency terms and ``per_step *
    size`` bytes per step on the measured link (e.g. 2-rank all-reduce: steps=2,
    per_step=0.5). ``weight="relative"``: least squares on the relative error (each
    timing weighted by ``1/t^2``), so the small sizes, where α dominates, count as much
    as the large ones and one noisy large timing does not set both terms;
    ``"absolute"``: plain least squares, for predicting megabyte messages, where β
    carries the time and a relative fit lets the small sizes' scheduling noise tilt β.
    α, β clamped at 0."""
    if weight not in ("relative", "absolute"):
        raise ValueError(f"unknown weight {weight!r} (relative or absolute)")
    xs = [per_step * s for s in sizes]
    ys = [t / steps for t in seconds]
    ws = [(1.0 / (y * y) if y > 0 else 0.0) if weight == "relative" else 1.0 for y in ys]
    sw = sum(ws)
    if sw == 0:
        return Link(0.0, 0.0)
    mx = sum(w * x for w, x in zip(ws, xs, strict=True)) / sw
    my = sum(w * y for w, y in zip(ws, ys, strict=True)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs, strict=True))
    sxy = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys, strict=True))
    beta = max(sxy / sxx if sxx else 0.0, 0.0)
    alpha = max(my - beta * mx, 0.0)
    return Link(alpha, beta)
