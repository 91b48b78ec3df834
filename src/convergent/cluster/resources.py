"""What this process may use: CPU counts from the affinity mask / Slurm, torch threads."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def usable_cpus() -> int:
    """CPUs this process may run on: SLURM_CPUS_ON_NODE if set, else the affinity mask.

    Never ``os.cpu_count()`` alone, which counts the whole machine.
    """
    slurm = os.environ.get("SLURM_CPUS_ON_NODE")
    if slurm and slurm.isdigit() and int(slurm) > 0:
        return int(slurm)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def cpu_name() -> str:
    """The CPU model name from /proc/cpuinfo (``platform.processor()`` where unavailable)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def set_torch_threads(n: int | None = None) -> int:
    """Set torch intra-op threads (default 1 per worker process); returns the count set."""
    import torch

    n = 1 if n is None else max(1, int(n))
    torch.set_num_threads(n)
    return n


def check_port_free(host: str, port: int) -> None:
    """InputError if ``host:port`` cannot be bound now (in use, or not an address here),
    checked before a server loads anything. SO_REUSEADDR as servers set it, so a port in
    TIME_WAIT is not mistaken for a busy one."""
    import socket

    from convergent.core.errors import InputError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise InputError(f"{host}: not a usable address ({exc.strerror})", hint="pass --host 127.0.0.1") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            raise InputError(f"cannot listen on {host}:{port}: {exc.strerror}",
                             hint="pass another --port (or stop what holds this one)") from None
