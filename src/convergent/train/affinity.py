"""Where each training process runs: node, host, pid, CPU affinity, and the HSDP groups.

:func:`ranks_record` is collective (every rank calls it once after the model is
parallelised); rank 0 writes the result to ``metrics.jsonl`` as one ``train.placement``
record (every start, restarts included; the device summary is the separate
``placement`` record of :mod:`convergent.cluster.placement`), so a run shows which cores each rank was pinned to (``srun --cpu-bind``, the
affinity mask torchrun inherits) and which ranks formed each HSDP shard group.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from convergent.train.topology import node_name


def local_placement() -> dict[str, Any]:
    """This process: rank, node (Slurm's name if any), host, pid, allowed CPUs."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return {
        "rank": int(os.environ.get("RANK", "0")),
        "node": node_name(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "cpus": cpus,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
    }


def ranks_record(mesh: Any = None) -> dict[str, Any]:
    """Every rank's :func:`local_placement` (collective) plus the HSDP groups of ``mesh``."""
    import torch.distributed as dist

    mine = local_placement()
    if dist.is_initialized() and dist.get_world_size() > 1:
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    else:
        ranks = [mine]
    rec: dict[str, Any] = {"kind": "train.placement", "ranks": ranks}
    names = getattr(mesh, "mesh_dim_names", None)
    if mesh is not None and names and tuple(names) == ("replicate", "shard"):
        groups = mesh.mesh.tolist()
        rec["hsdp_groups"] = groups
        rec["hsdp_group_nodes"] = [sorted({ranks[r]["node"] for r in g}) for g in groups]
    return rec
