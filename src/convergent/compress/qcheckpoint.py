"""Quantised checkpoints that load back: the Llama (HF layout) and the molecular surrogate.

**Llama.** :func:`save_quantized_llama` writes ``config.json`` (the model's HF config plus
``"convergent_quantization"``: the :class:`~convergent.compress.quant.QuantInfo`),
``model.safetensors`` with, per quantised layer, ``<name>.qweight`` (int8) and
``<name>.scale`` (fp32), and the source checkpoint's tokenizer files. Plain HF loaders
(and :func:`convergent.models.llama.load_pretrained`) refuse it loudly: the ``*.weight``
tensors they need are absent. :func:`load_llama` loads plain and quantised checkpoints,
whole or as a pipeline stage, and quantises a plain one on the fly when asked
(``serve.engine.quantize``). ``int8-dynamic`` is never stored packed: a plain checkpoint is
quantised at load (torch's packed format is not portable across kernels).

**Surrogate.** :func:`save_quantized_surrogate` writes the usual ``model_config.json`` +
``model.safetensors`` (:mod:`convergent.models.io`) with ``extra.quantization`` naming
the method and layers; :func:`load_surrogate` loads plain or quantised directories.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from convergent.compress.quant import (
    METHODS,
    Int8Embedding,
    QuantInfo,
    quantize,
    quantize_weight_only,
)
from convergent.core.errors import ConfigError, InputError
from convergent.core.fsutil import atomic_write_bytes, atomic_write_text, dumps_json

__all__ = [
    "QUANT_KEY",
    "load_llama",
    "load_surrogate",
    "quant_info",
    "save_quantized_llama",
    "save_quantized_surrogate",
]

QUANT_KEY = "convergent_quantization"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def quant_info(model_dir: str | Path) -> QuantInfo | None:
    """The quantisation recorded in a Llama checkpoint's ``config.json`` (None: plain)."""
    try:
        d = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # the plain loader names the problem
        return None
    q = d.get(QUANT_KEY) if isinstance(d, dict) else None
    return QuantInfo.from_dict(q) if isinstance(q, dict) else None


def _check_method(method: str, field: str) -> None:
    if method not in METHODS:
        raise ConfigError(f"{field}={method!r} is not one of {', '.join(METHODS)}")


def save_quantized_llama(model: nn.Module, info: QuantInfo, out: str | Path,
                         source: str | Path | None = None) -> Path:
    """Write a weight-only INT8 Llama (see the module doc); tokenizer files are copied
    from ``source`` when given."""
    from safetensors.torch import save

    from convergent.core.provenance import code_version

    if info.method != "int8":
        raise ConfigError(f"only int8 (weight-only) checkpoints are stored, not {info.method}",
                          hint="int8-dynamic is applied when a plain checkpoint is loaded")
    p = Path(out)
    p.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    atomic_write_bytes(p / "model.safetensors", save(state, metadata={"format": "pt", "quantization": "int8"}))
    hf = {**model.config.to_hf_dict(), QUANT_KEY: info.to_dict(),
          "convergent_code": code_version().to_dict()}
    if source is not None:
        for name in TOKENIZER_FILES:
            f = Path(source) / name
            if f.is_file():
                atomic_write_bytes(p / name, f.read_bytes())
    atomic_write_text(p / "config.json", dumps_json(hf, indent=2))  # last: marks it complete
    return p


def load_llama(
    path: str | Path,
    layers: Any = None,
    embed: bool = True,
    head: bool = True,
    dtype: torch.dtype = torch.float32,
    quantize_method: str = "none",
) -> nn.Module:
    """A plain or INT8 Llama checkpoint (whole, or the stage ``layers``/``embed``/``head``),
    quantised with ``quantize_method`` when the checkpoint is plain."""
    from convergent.models.llama import LlamaForCausalLM, Rotary, load_pretrained, read_config

    _check_method(quantize_method, "serve.engine.quantize")
    info = quant_info(path)
    if info is None:
        model = load_pretrained(path, layers, embed, head, dtype=dtype)
        if quantize_method == "int8-dynamic" and dtype != torch.float32:
            raise ConfigError("serve.engine.quantize=int8-dynamic needs serve.engine.dtype=float32")
        return quantize(model, quantize_method)[0].eval()
    if quantize_method not in ("none", info.method):
        raise ConfigError(f"{path}: already quantised ({info.method}); "
                          f"serve.engine.quantize={quantize_method} cannot apply on top")
    from safetensors import safe_open

    p = Path(path)
    config = read_config(p)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, layers, embed, head)
    quantize_weight_only(model, only=set(info.modules))
    wanted = set(model.state_dict())
    state: dict[str, torch.Tensor] = {}
    for f in sorted(p.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                if key in wanted:
                    t = fh.get_tensor(key)
                    state[key] = t if t.dtype == torch.int8 or key.endswith(".scale") else t.to(dtype)
    missing = sorted(wanted - set(state) - {k for k in wanted if "rotary" in k})
    if missing:
        raise InputError(f"{p}: tensors missing from the quantised checkpoint: {', '.join(missing[:5])}")
    model.load_state_dict(state, strict=False, assign=True)
    for m in model.modules():
        if isinstance(m, Int8Embedding):
            m.out_dtype = dtype
    model.model.rotary = Rotary(config)
    return model.eval()


def save_quantized_surrogate(model: nn.Module, cfg: Any, info: QuantInfo, out: str | Path,
                             extra: dict[str, Any] | None = None) -> Path:
    """A weight-only INT8 surrogate directory (``extra.quantization`` records the method)."""
    from convergent.models.io import save_model

    if info.method != "int8":
        raise ConfigError(f"only int8 (weight-only) surrogates are stored, not {info.method}")
    return save_model(model, cfg, out, extra={**(extra or {}), "quantization": info.to_dict()})


def load_surrogate(directory: str | Path, device: str = "cpu", quantize_method: str = "none") -> nn.Module:
    """A saved surrogate, plain or INT8, quantised with ``quantize_method`` when plain.

    ``int8-dynamic`` needs ``model.forces: direct`` (torch's dynamic kernels have no
    backward, and autograd forces differentiate through every layer).
    """
    from convergent.models.io import load_model, read_extra

    _check_method(quantize_method, "screen.quantize")
    d = Path(directory)
    try:
        q = read_extra(d).get("quantization")
    except (OSError, ValueError, AttributeError):  # load_model names the problem below
        q = None
    if q is None:
        model, cfg = load_model(d, "cpu")
        if quantize_method == "int8-dynamic" and cfg.forces != "direct":
            raise ConfigError(
                f"{d}: quantize=int8-dynamic needs a model with model.forces=direct "
                f"(this one: {cfg.forces})",
                hint="use quantize=int8 (weight-only; autograd forces flow through it)",
            )
        model = quantize(model, quantize_method, embeddings=False)[0]
        return model.to(device).eval()
    return _load_int8_surrogate(d, QuantInfo.from_dict(q), quantize_method).to(device).eval()


def _load_int8_surrogate(d: Path, info: QuantInfo, quantize_method: str) -> nn.Module:
    from safetensors.torch import load_file

    from convergent.models.config import ModelConfig
    from convergent.models.io import CONFIG, LEGACY, WEIGHTS, attach_elements
    from convergent.models.molecular import build_model

    if quantize_method not in ("none", info.method):
        raise ConfigError(f"{d}: already quantised ({info.method}); quantize={quantize_method} cannot apply")
    meta = json.loads((d / CONFIG).read_text(encoding="utf-8"))
    cfg = ModelConfig.model_validate({**LEGACY, **meta["model"]})
    model = build_model(cfg)
    quantize_weight_only(model, embeddings=False, only=set(info.modules))
    try:
        state = load_file(str(d / WEIGHTS), device="cpu")
    except OSError as exc:
        raise InputError(f"{d / WEIGHTS}: unreadable weights ({exc})") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise InputError(f"{d / WEIGHTS}: weights do not match the quantised config "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    attach_elements(model, meta, d)
    return model
