"""Where processes run: CPU or which GPU, how many ranks, which collective backend.

The rules (pure functions of the visible GPU count, testable without a GPU):

* ``train.device: auto`` is CUDA when at least one GPU is visible, else CPU;
  ``cuda`` with no GPU visible is an error.
* ``parallel.nproc: auto`` is the number of visible GPUs on CUDA, 2 on CPU
  (``strategy: single`` always runs one process).
* Rank ``r`` of a node uses ``cuda:LOCAL_RANK`` — device indices are relative to
  ``CUDA_VISIBLE_DEVICES`` (which Slurm's GPU binding sets), so more ranks than visible
  GPUs would put two ranks on one device (NCCL refuses): that is an error naming
  ``parallel.nproc``, the GPU count and the fix. Serving stages likewise
  (``serve.scheduler.stages``, one GPU per stage).
* Backend ``auto`` is NCCL on CUDA, gloo on CPU.

"Visible GPUs" is what torch sees (``torch.cuda.device_count()``, which honours
``CUDA_VISIBLE_DEVICES`` and does not initialise CUDA); inside a Slurm step the
launcher may run on a node without the GPUs, so ``SLURM_GPUS_ON_NODE`` wins when set.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from convergent.core.errors import ConfigError

__all__ = [
    "Placement",
    "check_serve_stages",
    "gpu_names",
    "placement_record",
    "plan_training",
    "visible_gpus",
]

CPU_DEFAULT_NPROC = 2


def _count_from_env(env: Mapping[str, str]) -> int | None:
    """GPUs per node granted by Slurm (``SLURM_GPUS_ON_NODE``), or None if not set."""
    v = env.get("SLURM_GPUS_ON_NODE", "").strip()
    return int(v) if v.isdigit() else None


def visible_gpus(env: Mapping[str, str] | None = None) -> int:
    """Number of CUDA devices this node's ranks may use (0 without CUDA)."""
    env = os.environ if env is None else env
    slurm = _count_from_env(env)
    if slurm is not None:
        return slurm
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install means "no GPU"
        return 0


def gpu_names(env: Mapping[str, str] | None = None) -> list[str]:
    """Names of the visible CUDA devices (empty without CUDA), from ``nvidia-smi``.

    Asking torch would create a CUDA context (hundreds of MiB of GPU memory) in the
    launcher for the whole run; ``nvidia-smi`` does not. ``CUDA_VISIBLE_DEVICES`` given
    as indices or UUIDs selects the devices listed.
    """
    env = os.environ if env is None else env
    cmd = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    vis = env.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        if not vis.strip():
            return []
        cmd.append(f"--id={vis.strip()}")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


@dataclass(frozen=True)
class Placement:
    """The resolved placement of a training job (recorded in the run)."""

    device: str  # "cpu" | "cuda"
    nproc: int  # processes per node
    backend: str  # "gloo" | "nccl"
    gpus: int  # visible GPUs on this node
    gpu_names: list[str] = field(default_factory=list)
    dtype: str = "fp32"

    def record(self) -> dict[str, Any]:
        return {"kind": "placement", **asdict(self)}


def _gpus_word(n: int) -> str:
    return f"{n} GPU" + ("" if n == 1 else "s")


def plan_training(
    device: str,
    nproc: int | str,
    strategy: str,
    backend: str,
    gpus: int,
    dtype: str = "fp32",
    names: list[str] | None = None,
    fit: bool = True,
) -> Placement:
    """Resolve ``train.device``/``parallel.nproc``/``parallel.backend`` for ``gpus`` GPUs.

    Raises :class:`ConfigError` (one line, exit code 2) when the request does not fit
    (``fit=False`` skips the ranks-vs-GPUs check: a command printed for other nodes).
    """
    if fit and device == "cuda" and gpus < 1:
        raise ConfigError(
            "train.device=cuda but no CUDA GPU is visible",
            hint="use train.device=cpu (or auto), or run on a GPU node",
        )
    dev = "cuda" if device == "cuda" or (device == "auto" and gpus > 0) else "cpu"
    if strategy == "single":
        n = 1
    elif nproc == "auto":
        n = gpus if dev == "cuda" else CPU_DEFAULT_NPROC
    else:
        n = int(nproc)
    if n < 1:
        raise ConfigError(f"parallel.nproc={nproc}: must be >= 1 (or auto)")
    if fit and dev == "cuda" and n > gpus:
        raise ConfigError(
            f"parallel.nproc={n} needs {n} GPUs per node but {_gpus_word(gpus)} "
            f"{'is' if gpus == 1 else 'are'} visible (one rank per GPU)",
            hint=f"set parallel.nproc={gpus} (or auto), or train.device=cpu to run "
            f"{n} CPU processes",
        )
    be = backend if backend != "auto" else ("nccl" if dev == "cuda" else "gloo")
    if be == "nccl" and dev == "cpu":
        raise ConfigError(
            "parallel.backend=nccl needs CUDA, but training runs on the CPU",
            hint="use parallel.backend=gloo (or auto)",
        )
    return Placement(dev, n, be, gpus if dev == "cuda" else 0, list(names or []), dtype)


def check_serve_stages(device: str, stages: int, gpus: int) -> None:
    """One GPU per serving stage: raise :class:`ConfigError` when they do not fit."""
    if device != "cuda":
        return
    if gpus < 1:
        raise ConfigError(
            "serve.engine.device=cuda but no CUDA GPU is visible",
            hint="use serve.engine.device=cpu, or run on a GPU node",
        )
    if stages > gpus:
        raise ConfigError(
            f"serve.scheduler.stages={stages} needs {stages} GPUs (one per stage) but "
            f"{_gpus_word(gpus)} {'is' if gpus == 1 else 'are'} visible",
            hint=f"set serve.scheduler.stages={gpus}, or serve.engine.device=cpu",
        )


def placement_record(
    device: Any, backend: str | None, world: int, dtype: str, tf32: bool
) -> dict[str, Any]:
    """What a running job uses (``device`` a torch.device): the run's placement record."""
    import torch

    cuda = device.type == "cuda"
    return {
        "kind": "placement",
        "device": device.type,
        "world": world,
        "backend": backend,
        "dtype": dtype,
        "tf32": bool(cuda and tf32),
        "gpu_names": [torch.cuda.get_device_name(device)] if cuda else [],
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
    }
