"""Save / load the molecular surrogate: ``model.safetensors`` + ``model_config.json``.

The directory is self-contained: the config (architecture), the weights and the buffers
(element reference energies, scale, shift). Files are written atomically.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from convergent.errors import InputError, parse_error_text
from convergent.fsutil import atomic_write_bytes, atomic_write_text
from convergent.models.config import ModelConfig
from convergent.provenance import code_version

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
    meta = {"format": FORMAT, "model": cfg.model_dump(mode="json"), "extra": extra or {},
            "code": code_version().to_dict()}
    atomic_write_text(out / CONFIG, json.dumps(meta, indent=2))
    return out


def load_model(directory: str | Path, device: str | torch.device = "cpu") -> tuple[nn.Module, ModelConfig]:
    """Load a model saved by :func:`save_model`; returns ``(model in eval mode, cfg)``.

    A missing or unreadable directory raises :class:`~convergent.errors.InputError`.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from convergent.models.molecular import build_model

    d = Path(directory)
    cfg_path, w_path = d / CONFIG, d / WEIGHTS
    if not cfg_path.is_file() or not w_path.is_file():
        raise InputError(
            f"{d}: not a model directory (needs {CONFIG} and {WEIGHTS})",
            hint="pass the directory written by training / save_model",
        )
    try:
        meta = json.loads(cfg_path.read_text(encoding="utf-8"))
        # saved before model.head_norm existed: those models had the head's LayerNorm
        cfg = ModelConfig.model_validate({"head_norm": True, **meta["model"]})
    except json.JSONDecodeError as exc:
        raise InputError(parse_error_text(cfg_path, "JSON", exc)) from None
    except (KeyError, ValueError) as exc:
        raise InputError(f"{cfg_path}: unreadable model config ({' '.join(str(exc).split())})") from None
    try:
        state = load_file(str(w_path), device="cpu")
    except (SafetensorError, OSError) as exc:
        raise InputError(f"{w_path}: unreadable weights ({exc})") from None
    model = build_model(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise InputError(
            f"{w_path}: weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    model.to(device).eval()
    return model, cfg
