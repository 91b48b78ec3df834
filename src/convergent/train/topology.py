"""Cluster topology for HSDP: which ranks share a node or a rack, and the 2-D mesh.

HSDP shards parameters inside a *shard group* (fast links: one node, or one rack) and
replicates across groups (slow links carry only the gradient all-reduce). The groups
come from, in order of preference:

1. ``parallel.shard_size`` — contiguous blocks of that many ranks;
2. ``parallel.topology_file`` — YAML/JSON with either ``groups: [[0, 1], [2, 3]]``
   (explicit rank lists) or ``racks: {rackname: [host, ...]}`` / ``hosts: {host: rack}``;
3. the node name of each rank (all-gathered; Slurm's ``SLURMD_NODENAME`` where set, else
   the host name), i.e. one group per node; with
   ``topology_level: rack`` hosts are grouped by rack from the topology file.

Slurm's compressed node lists (``SLURM_JOB_NODELIST=cn[001-004,010]``) are expanded by
:func:`expand_hostlist`; the launcher uses it to pick the rendezvous host.
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convergent.core.errors import ConfigError


def expand_hostlist(spec: str) -> list[str]:
    """Expand a Slurm host list: ``"a[1-3,5],b01"`` -> ``["a1","a2","a3","a5","b01"]``."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", spec):
        part = part.strip().strip(",")
        if not part:
            continue
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for rng in ranges.split(","):
            if "-" in rng:
                lo, hi = rng.split("-", 1)
                width = len(lo)
                for i in range(int(lo), int(hi) + 1):
                    hosts.append(f"{prefix}{i:0{width}d}{suffix}")
            else:
                hosts.append(f"{prefix}{rng}{suffix}")
    return hosts


def read_topology_file(path: str | Path) -> dict[str, Any]:
    """Read a topology file (YAML or JSON mapping); ConfigError naming the file if bad."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"topology file not found: {p}", hint="set parallel.topology_file")
    try:
        data = yaml.safe_load(p.read_text()) if p.suffix != ".json" else json.loads(p.read_text())
    except Exception as exc:  # noqa: BLE001 - any parse error is the user's file
        from convergent.core.errors import parse_error_text

        raise ConfigError(parse_error_text(p, "JSON" if p.suffix == ".json" else "YAML", exc)) from None
    if not isinstance(data, dict) or not ({"groups", "racks", "hosts"} & set(data)):
        raise ConfigError(f"{p}: expected a mapping with 'groups', 'racks' or 'hosts'")
    return data


def _host_to_rack(topo: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for rack, hosts in (topo.get("racks") or {}).items():
        for h in hosts if isinstance(hosts, list) else expand_hostlist(str(hosts)):
            out[str(h)] = str(rack)
    for host, rack in (topo.get("hosts") or {}).items():
        out[str(host)] = str(rack)
    return out


@dataclass(frozen=True)
class MeshLayout:
    """A (replicate, shard) arrangement of ranks: ``mesh[i][j]`` is a global rank."""

    mesh: list[list[int]]

    @property
    def replicate(self) -> int:
        return len(self.mesh)

    @property
    def shard(self) -> int:
        return len(self.mesh[0])


def group_ranks(
    world_size: int,
    hostnames: list[str] | None = None,
    shard_size: int | None = None,
    topology: dict[str, Any] | None = None,
    level: str = "node",
) -> MeshLayout:
    """Group ranks into equal shard groups following the topology (see module doc)."""
    ranks = list(range(world_size))
    if shard_size is not None:
        if shard_size < 1 or world_size % shard_size:
            raise ConfigError(
                f"parallel.shard_size={shard_size} does not divide the world size {world_size}"
            )
        return MeshLayout([ranks[i : i + shard_size] for i in range(0, world_size, shard_size)])
    groups: list[list[int]]
    if topology and "groups" in topology:
        groups = [[int(r) for r in g] for g in topology["groups"]]
        flat = sorted(r for g in groups for r in g)
        if flat != ranks:
            raise ConfigError(
                f"topology 'groups' must list every rank 0..{world_size - 1} exactly once"
            )
    else:
        hostnames = hostnames or [socket.gethostname()] * world_size
        rack_of = _host_to_rack(topology or {})
        if level == "rack":
            keys = [rack_of.get(h, h) for h in hostnames]
        else:
            keys = list(hostnames)
        order: dict[str, list[int]] = {}
        for r, k in enumerate(keys):
            order.setdefault(k, []).append(r)
        groups = list(order.values())
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ConfigError(
            f"HSDP needs equal shard groups, got sizes {sorted(len(g) for g in groups)}",
            hint="set parallel.shard_size or fix the topology file",
        )
    return MeshLayout(groups)


def node_name() -> str:
    """This process's node: Slurm's name for it (``SLURMD_NODENAME``, set in every step;
    several emulated nodes may share one host) or else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def gather_hostnames() -> list[str]:
    """Every rank's :func:`node_name`, indexed by rank (collective; needs a process group)."""
    import torch.distributed as dist

    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, node_name())
    return [str(n) for n in names]
