"""What an engine is built from: a checkpoint whose weights it can read, the number of
pipeline stages, and one :class:`~convergent.serve.stage.StageSpec` per stage; and which
``config.json`` keys set the model's own context (the KV blocks are sized by
:mod:`convergent.serve.memory`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from convergent.core.errors import ConfigError, InputError
from convergent.serve.config import EngineConfig, SchedulerConfig
from convergent.serve.stage import StageSpec

if TYPE_CHECKING:
    from convergent.models.llama_config import LlamaConfig

__all__ = ["check_weights", "context_source", "pipeline_stages", "stage_specs"]


def check_weights(model_dir: Path) -> None:
    """Refuse (before any stage starts: exit 2) a checkpoint without ``*.safetensors``
    weights, naming what it has instead (``pytorch_model.bin`` pickles are not loaded)."""
    if any(model_dir.glob("*.safetensors")):
        return
    bins = sorted(p.name for p in model_dir.glob("pytorch_model*.bin"))
    convert = (
        'convert it once: python -c "from transformers import AutoModelForCausalLM as M; '
        f"M.from_pretrained('{model_dir}').save_pretrained('{model_dir}')\""
    )
    if bins:
        raise InputError(
            f"{model_dir}: weights only as {bins[0]} (PyTorch pickle); serving reads *.safetensors",
            hint=convert,
        )
    raise InputError(f"{model_dir}: no *.safetensors weights", hint="pass a Hugging Face checkpoint")


def context_source(mcfg: LlamaConfig) -> str:
    """The ``config.json`` keys that set the model's own context (``mcfg.max_context``):
    ``sliding_window=16`` where the window caps it, else ``max_position_embeddings`` (with
    a linear / dynamic RoPE factor)."""
    if mcfg.sliding_window and int(mcfg.sliding_window) == mcfg.max_context:
        return f"sliding_window={mcfg.sliding_window}"
    src = f"max_position_embeddings={mcfg.max_position_embeddings}"
    rs = mcfg.rope_scaling or {}
    if rs.get("rope_type") in ("linear", "dynamic"):
        src += f" x rope_scaling.factor={rs.get('factor', 1.0)}"
    return src


def pipeline_stages(cfg: SchedulerConfig, device: str, mcfg: LlamaConfig) -> int:
    """Stages of the pipeline (one for ``sequential``) on ``device``; a ConfigError for
    more stages than layers or, on CUDA, than GPUs (exit 2)."""
    from convergent.cluster.placement import check_serve_stages, visible_gpus

    p = 1 if cfg.kind == "sequential" else cfg.stages
    if p < 1 or p > mcfg.num_hidden_layers:
        raise ConfigError(
            f"serve.scheduler.stages={cfg.stages}: must be between 1 and the model's "
            f"{mcfg.num_hidden_layers} layers"
        )
    # one GPU per stage: too many stages for the GPUs is a one-line error (exit 2)
    check_serve_stages(device, p, visible_gpus() if device == "cuda" else 0)
    return p


def stage_specs(model_dir: Path, cfg: EngineConfig, stages: int, num_blocks: int) -> list[StageSpec]:
    """How to build each of ``stages`` stages of the checkpoint at ``model_dir``."""
    return [StageSpec(str(model_dir), s, stages, num_blocks, cfg) for s in range(stages)]
