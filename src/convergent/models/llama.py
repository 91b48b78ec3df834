"""A Llama-architecture decoder: RMSNorm, RoPE (default / linear / dynamic NTK / llama3),
grouped-query attention, SwiGLU — the public names in one place.

Two forwards share the same weights:

* ``LlamaForCausalLM(config)(input_ids) -> logits`` — a plain, dense, causal training
  forward (``input_ids`` of shape ``[batch, seq]``; logits ``[batch, seq, vocab]``).
* :meth:`LlamaModel.forward_paged` — the serving forward over a *packed* batch of
  sequences whose keys/values live in a paged KV cache (used by ``convergent.serve``).
  A model may hold only a contiguous slice of the layers (a pipeline stage):
  ``LlamaModel(config, layers=range(a, b), embed=..., head=...)``.

Parameter names follow Hugging Face (``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.q_proj.weight``, ..., ``lm_head.weight``) so a Hugging Face
checkpoint directory (``config.json`` + ``*.safetensors``) loads directly with
:func:`load_pretrained` and :func:`save_pretrained` writes one back.

Where each part lives (one job per module): :mod:`~convergent.models.llama_config` (the
config), :mod:`~convergent.models.llama_rope` (rotary embeddings),
:mod:`~convergent.models.llama_model` (the modules), :mod:`~convergent.models.llama_paged`
(the paged-KV serving path), :mod:`~convergent.models.llama_hf` (checkpoints).
"""

from __future__ import annotations

from convergent.models.llama_config import MLP_ACTS, LlamaConfig
from convergent.models.llama_hf import load_pretrained, read_config, save_pretrained
from convergent.models.llama_model import (
    MLP,
    Attention,
    DecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    RMSNorm,
)
from convergent.models.llama_paged import (
    DecodeGroup,
    PagedBatch,
    PrefillGroup,
    pad_groups,
    paged_attention,
)
from convergent.models.llama_rope import Rotary, apply_rope_signed, rope_inv_freq

__all__ = [
    "MLP",
    "MLP_ACTS",
    "Attention",
    "DecodeGroup",
    "DecoderLayer",
    "LlamaConfig",
    "LlamaForCausalLM",
    "LlamaModel",
    "PagedBatch",
    "PrefillGroup",
    "RMSNorm",
    "Rotary",
    "apply_rope_signed",
    "load_pretrained",
    "pad_groups",
    "paged_attention",
    "read_config",
    "rope_inv_freq",
    "save_pretrained",
]
