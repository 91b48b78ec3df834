"""Hugging Face checkpoint directories (``config.json`` + ``*.safetensors``) for the Llama
decoder: read and check the config, load the tensors a (partial) model holds, write one
back."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from convergent.core.errors import ConfigError, InputError, parse_error_text
from convergent.core.fsutil import atomic_write_text, dumps_json
from convergent.core.provenance import code_version
from convergent.models.hf_check import check_supported
from convergent.models.llama_config import LlamaConfig
from convergent.models.llama_model import LlamaForCausalLM
from convergent.models.llama_rope import Rotary

__all__ = ["load_pretrained", "read_config", "save_pretrained"]


def read_config(path: str | Path) -> LlamaConfig:
    """Read and check ``config.json`` of a Hugging Face Llama checkpoint directory.

    An unsupported setting raises :class:`~convergent.core.errors.ConfigError` (see
    :func:`convergent.models.hf_check.check_supported`); Mistral's ``sliding_window`` is
    honoured by capping the context at the window (:attr:`LlamaConfig.max_context`), or ignored when
    ``use_sliding_window`` is false.
    """
    p = Path(path)
    cfg_file = p / "config.json" if p.is_dir() else p
    try:
        with open(cfg_file, encoding="utf-8") as fh:
            d = json.load(fh)
    except json.JSONDecodeError as exc:
        raise InputError(parse_error_text(cfg_file, "JSON", exc)) from None
    if not isinstance(d, dict):
        raise ConfigError(f"{cfg_file}: not a JSON object")
    check_supported(d, str(cfg_file))
    if d.get("use_sliding_window") is False:
        d = {**d, "sliding_window": None}
    try:
        return LlamaConfig.from_hf_dict(d)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{cfg_file}: {exc}") from None


def load_pretrained(
    path: str | Path,
    layers: Iterable[int] | None = None,
    embed: bool = True,
    head: bool = True,
    dtype: torch.dtype = torch.float32,
) -> LlamaForCausalLM:
    """Load a Hugging Face Llama checkpoint directory (``config.json`` + ``*.safetensors``).

    Only the tensors this (possibly partial) model holds are read. Raises
    ``FileNotFoundError`` / ``KeyError`` on a missing file or tensor.
    """
    from safetensors import safe_open

    p = Path(path)
    config = read_config(p)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, layers, embed, head)
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{p}: no *.safetensors file")
    wanted = {n for n, _ in model.named_parameters()}
    if head and config.tie_word_embeddings:
        wanted.add("lm_head.weight")
    state: dict[str, torch.Tensor] = {}

    def own(t: torch.Tensor) -> torch.Tensor:
        # a copy of its own: a tensor of the file's mapping keeps the whole mapping resident
        # while any one lives (a serving stage that drops its plain weights, keeping the
        # embedding, held the checkpoint's pages beside its packed copy: 2x the weights)
        return t.to(dtype) if t.dtype != dtype else t.clone()

    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                if key in wanted:
                    state[key] = own(fh.get_tensor(key))
                elif key == "model.embed_tokens.weight" and head and config.tie_word_embeddings:
                    state["lm_head.weight"] = own(fh.get_tensor(key))
    if head and config.tie_word_embeddings and "lm_head.weight" not in state:
        if "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing = sorted(n for n, _ in model.named_parameters() if n not in state)
    if missing:
        raise KeyError(f"{p}: tensors missing from the checkpoint: {', '.join(missing[:5])}")
    model.load_state_dict(state, strict=False, assign=True)
    if head and embed and config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary = Rotary(config)  # buffers were created on meta
    return model.eval()


def save_pretrained(model: LlamaForCausalLM, path: str | Path) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the Hugging Face layout."""
    from safetensors.torch import save_file

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tmp = p / ".model.safetensors.partial"
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(p / "model.safetensors")
    hf = {**model.config.to_hf_dict(), "convergent_code": code_version().to_dict()}
    atomic_write_text(p / "config.json", dumps_json(hf, indent=2))
    return p
