"""Save / load the molecular surrogate: ``model.safetensors`` + ``model_config.json``.

The directory is self-contained: the config (architecture; its ``model.kind`` says which
network to build: ``molecular`` or ``mace``, also written as the top-level ``kind``), the
weights and the buffers (element reference energies, scale, shift; MACE's element table
and ``avg_num_neighbors``), and ``elements``: the atomic numbers the model was trained on
(:func:`trained_elements`; ``null`` for a model never fitted to data). Files are written
atomically. :func:`check_elements` refuses a structure with any other element.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from convergent.core.elements import symbol
from convergent.core.errors import InputError, parse_error_text
from convergent.core.fsutil import atomic_write_bytes, atomic_write_text, dumps_json
from convergent.core.provenance import code_version
from convergent.models.config import ModelConfig

WEIGHTS = "model.safetensors"
CONFIG = "model_config.json"
FORMAT = "convergent-molecular/1"


def _unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DDP / torch.compile wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None or not isinstance(inner, nn.Module):
            return model
        model = inner


def save_model(
    model: nn.Module, cfg: ModelConfig, directory: str | Path, extra: dict[str, Any] | None = None
) -> Path:
    """Write ``directory/model.safetensors`` and ``directory/model_config.json``.

    ``extra`` (JSON-able, e.g. training metrics or the dataset it was trained on) is stored
    under ``"extra"`` in the config file. Returns the directory.
    """
    from safetensors.torch import save

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for k, v in _unwrap(model).state_dict().items():
        if hasattr(v, "full_tensor"):  # FSDP2 DTensor shard -> full tensor (collective)
            v = v.full_tensor()
        state[k] = v.detach().cpu().contiguous()
    atomic_write_bytes(out / WEIGHTS, save(state, metadata={"format": FORMAT}))
    elements = trained_elements(model)
    meta = {"format": FORMAT, "kind": cfg.kind, "model": cfg.model_dump(mode="json"),
            "extra": extra or {},
            "code": code_version().to_dict(),
            "elements": list(elements) if elements is not None else None}
    if elements is None:
        meta["elements_null_reason"] = "no element reference energies: never fitted to data"
    atomic_write_text(out / CONFIG, dumps_json(meta, indent=2))
    return out


def trained_elements(model: nn.Module) -> tuple[int, ...] | None:
    """The atomic numbers ``model`` was trained on, sorted: its ``trained_elements``
    record (set by ``set_reference`` and by loading), else the elements with a fitted
    reference energy (checkpoints saved before the record); None when neither exists."""
    m = _unwrap(model)
    rec = getattr(m, "trained_elements", None)
    if rec is not None:
        return tuple(sorted(int(z) for z in rec))
    ref = getattr(m, "atomref", None)
    if isinstance(ref, torch.Tensor) and bool((ref != 0).any()):
        return tuple(int(z) for z in torch.nonzero(ref).flatten().tolist())
    return None


def attach_elements(model: nn.Module, meta: dict[str, Any], where: Path) -> None:
    """Set ``model.trained_elements`` from a loaded config's ``elements`` record; a
    checkpoint saved before the record falls back to its fitted reference energies and is
    refused when it has none (nothing says which elements it knows)."""
    if "elements" in meta:
        rec = meta["elements"]
        model.trained_elements = None if rec is None else tuple(int(z) for z in rec)
        return
    if trained_elements(model) is None:
        raise InputError(
            f"{where}: this checkpoint predates element recording and holds no element "
            "reference energies, so the elements it was trained on are unknown",
            hint="re-export it with this version (convergent train) so model_config.json "
                 "records 'elements'")


def check_elements(models: Sequence[nn.Module], numbers: Any, where: str) -> None:
    """Raise :class:`InputError` naming the element and ``where`` (the structure) when
    ``numbers`` holds an element some model was not trained on."""
    present = sorted({int(z) for z in np.asarray(numbers).ravel()})
    for m in models:
        known = trained_elements(m)
        if known is None:
            continue  # never fitted to data: no element set to hold it to
        bad = [z for z in present if z not in known]
        if bad:
            names = ", ".join(f"{symbol(z)} (Z={z})" for z in bad)
            raise InputError(
                f"{where}: element {names} not among those the model was trained on "
                f"({', '.join(symbol(z) for z in known)}); its prediction would be meaningless",
                hint="screen only structures of the model's elements, or train on data "
                     "that contains them")


#: What a model config saved before a field existed meant: the head's LayerNorm was there
#: (model.head_norm) and no repulsive prior (model.repulsion).
LEGACY: dict[str, Any] = {"head_norm": True, "repulsion": "none"}


def load_model(directory: str | Path, device: str | torch.device = "cpu") -> tuple[nn.Module, ModelConfig]:
    """Load a model saved by :func:`save_model`; returns ``(model in eval mode, cfg)``.

    A missing or unreadable directory raises :class:`~convergent.core.errors.InputError`.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = Path(directory)
    cfg_path, w_path = d / CONFIG, d / WEIGHTS
    if not cfg_path.is_file() or not w_path.is_file():
        raise InputError(
            f"{d}: not a model directory (needs {CONFIG} and {WEIGHTS})",
            hint="pass the directory written by training / save_model",
        )
    try:
        meta = json.loads(cfg_path.read_text(encoding="utf-8"))
        cfg = ModelConfig.model_validate({**LEGACY, **meta["model"]})
    except json.JSONDecodeError as exc:
        raise InputError(parse_error_text(cfg_path, "JSON", exc)) from None
    except (KeyError, ValueError) as exc:
        raise InputError(f"{cfg_path}: unreadable model config ({' '.join(str(exc).split())})") from None
    try:
        state = load_file(str(w_path), device="cpu")
    except (SafetensorError, OSError) as exc:
        raise InputError(f"{w_path}: unreadable weights ({exc})") from None
    model = build_saved(cfg, state, w_path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise InputError(
            f"{w_path}: weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    attach_elements(model, meta, d)
    model.to(device).eval()
    return model, cfg


def build_saved(cfg: ModelConfig, state: dict[str, torch.Tensor], where: Path) -> nn.Module:
    """A fresh network of ``cfg.kind`` shaped for the saved ``state`` (weights not loaded):
    the molecular model from its config alone, MACE from its config and the element table
    and neighbour normalisation stored in its weights (mace-torch needed)."""
    if cfg.kind == "mace":
        from convergent.models.mace import mace_from_state

        if "net.atomic_numbers" not in state or "avg_num_neighbors" not in state:
            raise InputError(f"{where}: not the weights of a MACE model (no element table)")
        return mace_from_state(cfg, state)
    if cfg.kind in ("schnet", "painn"):
        from convergent.models.schnetpack import SpkModel

        return SpkModel(cfg)
    if cfg.kind != "molecular":
        raise InputError(f"{where}: model.kind={cfg.kind} is not a surrogate model directory")
    from convergent.models.molecular import build_model

    return build_model(cfg)


def read_extra(directory: str | Path) -> dict[str, Any]:
    """The ``extra`` metadata stored with a saved model (e.g. its quantisation method)."""
    meta = json.loads((Path(directory) / CONFIG).read_text(encoding="utf-8"))
    return dict(meta.get("extra", {}))
