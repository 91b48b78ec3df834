"""Run ranks on the emulated two-node network of ``scripts/netemu.sh`` (root only).

:class:`EmulatedNetwork` creates the two namespaces (``<name>A``/``<name>B``) joined by a
token-bucket-shaped veth pair, removes them on exit (also after errors), and starts one
process per rank inside the namespace of its node with the ``env://`` variables set:
rank 0 lives on node A and hosts the TCP store at 10.231.0.1; gloo binds to the node's
veth (``GLOO_SOCKET_IFNAME``), so traffic between the nodes crosses the shaped link and
traffic inside a node stays on the namespace's local path. :func:`link_bytes` reads the
interface counters of a node's link (``/sys/class/net/<dev>/statistics``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from bench.lib.paths import REPO

SCRIPT = REPO / "scripts" / "netemu.sh"
ADDR = {0: "10.231.0.1", 1: "10.231.0.2"}


def unavailable() -> str | None:
    """Why this machine cannot build the emulated network, or None if it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc shaping)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs iproute2's {tool}"
    return None


class EmulatedNetwork:
    """Two emulated nodes joined by one shaped link; use as a context manager."""

    def __init__(self, name: str, rate: str = "none") -> None:
        self.name, self.rate = name, rate

    def ns(self, node: int) -> str:
        return f"{self.name}{'AB'[node]}"

    def dev(self, node: int) -> str:
        return f"{self.name}{'ab'[node]}"

    def __enter__(self) -> EmulatedNetwork:
        subprocess.run([str(SCRIPT), "up", self.name, self.rate], check=True)
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run([str(SCRIPT), "down", self.name], check=False)

    def shape(self, rate: str) -> None:
        subprocess.run([str(SCRIPT), "shape", self.name, rate], check=True)
        self.rate = rate

    def link_bytes(self, node: int) -> dict[str, int]:
        """tx/rx byte counters of ``node``'s inter-node link."""
        out = {}
        for key in ("tx_bytes", "rx_bytes"):
            p = subprocess.run(
                ["ip", "netns", "exec", self.ns(node), "cat",
                 f"/sys/class/net/{self.dev(node)}/statistics/{key}"],
                check=True, capture_output=True, text=True,
            )
            out[key] = int(p.stdout)
        return out

    def spawn(
        self, argv: Sequence[str], node_of_rank: Sequence[int], port: int = 29611,
        env: dict[str, str] | None = None, log_dir: Path | None = None,
        node_cpus: Sequence[int] | None = None,
    ) -> list[subprocess.Popen]:
        """Start one process per rank, rank ``r`` on node ``node_of_rank[r]``; with
        ``node_cpus``, every rank of node ``n`` is pinned to CPU ``node_cpus[n]`` (a node
        has a CPU of its own, as real nodes do, instead of all ranks sharing every core)."""
        if node_of_rank[0] != 0:
            raise ValueError("rank 0 must be on node 0 (it hosts the store)")
        world = len(node_of_rank)
        procs = []
        for r, node in enumerate(node_of_rank):
            local = [q for q in range(world) if node_of_rank[q] == node]
            e = dict(os.environ, **(env or {}))
            e.update(
                RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(local.index(r)),
                LOCAL_WORLD_SIZE=str(len(local)), GROUP_RANK=str(node),
                MASTER_ADDR=ADDR[0], MASTER_PORT=str(port),
                GLOO_SOCKET_IFNAME=self.dev(node), OMP_NUM_THREADS="1",
                CONVERGENT_NETEMU_DEV=self.dev(node),
            )
            out = open(log_dir / f"rank{r}.log", "w") if log_dir else subprocess.DEVNULL  # noqa: SIM115
            pin = ["taskset", "-c", str(node_cpus[node])] if node_cpus is not None else []
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", self.ns(node), *pin, *argv], env=e,
                stdout=out, stderr=subprocess.STDOUT,
            ))
        return procs


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Wait for every process; kill the rest if one fails or time runs out."""
    import time

    deadline = time.monotonic() + timeout
    codes: list[int | None] = [None] * len(procs)
    while any(c is None for c in codes):
        for i, p in enumerate(procs):
            if codes[i] is None:
                codes[i] = p.poll()
        if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            return [p.wait() for p in procs]
        time.sleep(0.1)
    return [int(c) for c in codes if c is not None]
