"""What an engine is built from: the number of pipeline stages, the KV blocks of the
byte budget, and one :class:`~convergent.serve.stage.StageSpec` per stage."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from convergent.errors import ConfigError
from convergent.serve.config import ServeConfig
from convergent.serve.kv_cache import blocks_for_budget
from convergent.serve.stage import StageSpec

if TYPE_CHECKING:
    from convergent.models.llama_config import LlamaConfig

__all__ = ["kv_blocks", "pipeline_stages", "stage_specs"]


def pipeline_stages(cfg: ServeConfig, mcfg: LlamaConfig) -> int:
    """Stages of the pipeline (one for ``sequential``); a ConfigError for more stages than
    layers or, on CUDA, than GPUs (exit 2)."""
    from convergent.placement import check_serve_stages, visible_gpus

    p = 1 if cfg.scheduler == "sequential" else cfg.stages
    if p < 1 or p > mcfg.num_hidden_layers:
        raise ConfigError(
            f"serve.stages={cfg.stages}: must be between 1 and the model's "
            f"{mcfg.num_hidden_layers} layers"
        )
    # one GPU per stage: too many stages for the GPUs is a one-line error (exit 2)
    check_serve_stages(cfg.device, p, visible_gpus() if cfg.device == "cuda" else 0)
    return p


def kv_blocks(cfg: ServeConfig, mcfg: LlamaConfig) -> int:
    """KV blocks (K and V of every layer) that ``serve.kv_budget_bytes`` holds; a
    ConfigError when not even one fits."""
    per_token = mcfg.kv_bytes_per_token(dtype_bytes=4 if cfg.dtype == "float32" else 2)
    num_blocks = blocks_for_budget(cfg.kv_budget_bytes, per_token, cfg.block_size)
    if num_blocks < 1:
        raise ConfigError(
            f"serve.kv_budget_bytes={cfg.kv_budget_bytes} is smaller than one KV block",
            hint=f"one block needs {per_token * cfg.block_size} bytes",
        )
    return num_blocks


def stage_specs(model_dir: Path, cfg: ServeConfig, stages: int, num_blocks: int) -> list[StageSpec]:
    """How to build each of ``stages`` stages of the checkpoint at ``model_dir``."""
    return [
        StageSpec(
            str(model_dir),
            s,
            stages,
            num_blocks,
            cfg.block_size,
            cfg.dtype,
            cfg.torch_threads,
            cfg.device,
            cfg.quantize,
        )
        for s in range(stages)
    ]
