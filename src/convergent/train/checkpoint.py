"""Checkpoints with torch.distributed.checkpoint (DCP): save, resume, retain, export.

Layout under ``run.ckpt``::

    step_00000100/          one checkpoint (DCP shards + .metadata)
        rank_00000.pt       per-rank extras: RNG states (torch, numpy, python), world
                            size and ``local`` state (e.g. gradient-compression error
                            feedback, which differs per rank)
        COMPLETE            written by rank 0 last (JSON: step, world, time, code) — a
                            directory without it is ignored and removed later
    final/                  safetensors export of the final weights (models.io layout)

What is saved: model and optimizer state via ``get_state_dict`` with flattened,
FQN-keyed optimizer state (so DDP, FSDP2, HSDP and pipeline checkpoints share one key
space: a checkpoint written by N ranks loads on M ranks and across strategies; DCP
reshards DTensors on load), the LR scheduler, the step and the data-loader state
(the global batch plan position), and each rank's RNG states.

``async_save`` writes with ``dcp.async_save`` on a separate gloo group in a background
thread; ``COMPLETE`` is written once the write has finished (checked before the next
save and at the end), so an interrupted async write is never resumed from.
"""

from __future__ import annotations

import io
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from convergent.core.fsutil import atomic_write_text, dumps_json
from convergent.core.provenance import code_version

_STEP_RE = re.compile(r"^step_(\d{8})$")


def rng_state() -> dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of complete checkpoints under ``root``, oldest first."""
    out = []
    if not root.exists():
        return out
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and (p / "COMPLETE").exists():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint directory, or None."""
    found = complete_checkpoints(Path(root))
    return found[-1][1] if found else None


class _Parts:
    """Model parts and optimizers of one rank (one each, or one per pipeline stage)."""

    def __init__(self, parts: list[torch.nn.Module], optims: list[torch.optim.Optimizer]):
        self.parts, self.optims = parts, optims
        self.opts = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict[str, Any]:
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        for m, o in zip(self.parts, self.optims, strict=True):
            model.update(get_model_state_dict(m, options=self.opts))
            optim.update(get_optimizer_state_dict(m, o, options=self.opts))
        return {"model": model, "optim": optim}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for m, o in zip(self.parts, self.optims, strict=True):
            msd = get_model_state_dict(m, options=self.opts)
            set_model_state_dict(m, {k: sd["model"][k] for k in msd}, options=self.opts)
            osd = get_optimizer_state_dict(m, o, options=self.opts)
            set_optimizer_state_dict(
                m, o, {k: sd["optim"][k] for k in osd}, options=self.opts
            )


class CheckpointManager:
    """Save/resume/retain DCP checkpoints for one training run (collective calls)."""

    def __init__(
        self,
        root: str | Path,
        keep: int = 2,
        async_save: bool = False,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        self.root = Path(root)
        self.keep = max(1, keep)
        self.async_save = async_save
        self.rank, self.world = rank, world
        self._pending: tuple[Any, int, Path] | None = None
        self._group = None
        if async_save and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def path_for(root: Path, step: int) -> Path:
        return root / f"step_{step:08d}"

    def _state(self, parts: _Parts, extra: dict[str, Any] | None) -> dict[str, Any]:
        sd = parts.state_dict()
        buf = io.BytesIO()
        if extra is not None:
            torch.save(extra, buf)
            buf.seek(0)
        sd["train"] = buf  # step, scheduler, data-loader state: one replicated blob
        return sd

    def save(
        self,
        step: int,
        parts: list[torch.nn.Module],
        optims: list[torch.optim.Optimizer],
        extra: dict[str, Any],
        local: dict[str, Any] | None = None,
    ) -> Path:
        """Write checkpoint ``step`` (collective); returns its directory.

        ``local`` is this rank's own state, stored in its rank file next to its RNG.
        """
        self.wait()
        path = self.path_for(self.root, step)
        if self.rank == 0 and path.exists():
            shutil.rmtree(path)  # an incomplete leftover of a crashed attempt
        if dist.is_initialized():
            dist.barrier()
        state = self._state(_Parts(parts, optims), extra)
        path.mkdir(parents=True, exist_ok=True)
        torch.save(
            {"rng": rng_state(), "world": self.world, "local": local},
            path / f"rank_{self.rank:05d}.pt",
        )
        if self.async_save:
            fut = dcp.async_save(state, checkpoint_id=str(path), process_group=self._group)
            self._pending = (fut, step, path)
        else:
            dcp.save(state, checkpoint_id=str(path))
            self._finish(step, path)
        return path

    def _finish(self, step: int, path: Path) -> None:
        if dist.is_initialized():
            dist.barrier()
        if self.rank == 0:
            atomic_write_text(
                path / "COMPLETE",
                dumps_json({"step": step, "world": self.world, "time": time.time(),
                            "code": code_version().to_dict()}),
            )
            self._retain()
        if dist.is_initialized():
            dist.barrier()

    def wait(self) -> None:
        """Finish a pending async save (writes its COMPLETE marker)."""
        if self._pending is None:
            return
        fut, step, path = self._pending
        self._pending = None
        res = fut.result() if hasattr(fut, "result") else None
        del res
        self._finish(step, path)

    def _retain(self) -> None:
        found = complete_checkpoints(self.root)
        for _, p in found[: -self.keep]:
            shutil.rmtree(p, ignore_errors=True)
        newest = found[-1][0] if found else -1
        for p in self.root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and not (p / "COMPLETE").exists() and int(m.group(1)) < newest:
                shutil.rmtree(p, ignore_errors=True)

    def load(
        self,
        path: Path,
        parts: list[torch.nn.Module],
        optims: list[torch.optim.Optimizer],
    ) -> dict[str, Any]:
        """Load checkpoint ``path`` into the parts/optimizers (collective); returns extras.

        Restores this rank's RNG states, and returns its ``local`` state as
        ``extra["local"]``, when the checkpoint was written by the same number of ranks
        (with a different number the data plan, which is global, still resumes exactly;
        RNG streams restart from the seed, ``extra["local"]`` is None).
        """
        p = _Parts(parts, optims)
        state = self._state(p, None)
        dcp.load(state, checkpoint_id=str(path))
        p.load_state_dict(state)
        buf = state["train"]
        buf.seek(0)
        extra = dict(torch.load(buf, weights_only=False))
        extra["local"] = None
        rank_file = path / f"rank_{self.rank:05d}.pt"
        if rank_file.exists():
            saved = torch.load(rank_file, weights_only=False)
            if saved.get("world") == self.world:
                set_rng_state(saved["rng"])
                extra["local"] = saved.get("local")
        return extra


def load_full_model(path: str | Path, model: torch.nn.Module) -> torch.nn.Module:
    """Load the model weights of a DCP checkpoint into a plain (unsharded) module.

    Works in a process without a process group (e.g. the final export on rank 0).
    """
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    model.load_state_dict(sd["model"])
    return model
