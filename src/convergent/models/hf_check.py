"""Which Hugging Face checkpoint configs :mod:`convergent.models.llama` computes exactly.

:func:`check_supported` refuses, with one line naming the key and its value, every
setting that would make the served model silently differ from the checkpoint's own
(another architecture, an activation or RoPE variant we do not implement, quantization,
logit soft-capping, ...). Implemented variants: SiLU / GELU / ReLU gated MLPs, RoPE
default / linear / dynamic / llama3, attention and MLP biases, tied embeddings, Mistral's
sliding window (served up to the window, where it equals full attention).
"""

from __future__ import annotations

from typing import Any

from convergent.models.llama_config import MLP_ACTS

__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_MODEL_TYPES", "SUPPORTED_ROPE", "check_supported"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE = ("default", "linear", "dynamic", "llama3")
_ROPE_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ),
}
# keys that change the computation of architectures we do not implement
_REFUSED_KEYS = (
    "quantization_config",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "use_qk_norm",
    "qk_layernorm",
    "residual_multiplier",
    "embedding_multiplier",
    "logits_scaling",
    "attention_multiplier",
)


def check_supported(d: dict[str, Any], source: str = "config.json") -> None:
    """Refuse a checkpoint config whose model this implementation would compute wrongly.

    Raises :class:`~convergent.core.errors.ConfigError` naming the key and its value.
    """
    from convergent.core.errors import ConfigError

    def refuse(key: str, value: Any, supported: str) -> None:
        raise ConfigError(
            f"{source}: {key}={value!r} is not supported (supported: {supported})",
            hint="convergent serves Llama-architecture checkpoints (llama, mistral)",
        )

    mt = d.get("model_type", "llama")
    if mt not in SUPPORTED_MODEL_TYPES:
        refuse("model_type", mt, ", ".join(SUPPORTED_MODEL_TYPES))
    for arch in d.get("architectures") or []:
        if arch not in SUPPORTED_ARCHITECTURES:
            refuse("architectures", arch, ", ".join(SUPPORTED_ARCHITECTURES))
    act = d.get("hidden_act", "silu")
    if act not in MLP_ACTS:
        refuse("hidden_act", act, ", ".join(MLP_ACTS))
    for key in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if key in d and not isinstance(d[key], bool):
            refuse(key, d[key], "true or false")
    for key in _REFUSED_KEYS:
        if d.get(key) not in (None, False, 1, 1.0):
            refuse(key, d[key], "absent")
    sw = d.get("sliding_window")
    if sw is not None and (not isinstance(sw, int) or isinstance(sw, bool) or sw < 1):
        refuse("sliding_window", sw, "null or a positive integer")
    for lt in d.get("layer_types") or []:
        if lt not in ("full_attention", "sliding_attention"):
            refuse("layer_types", lt, "full_attention, sliding_attention")
    tp = d.get("pretraining_tp", 1)
    if tp is not None and not isinstance(tp, int):
        refuse("pretraining_tp", tp, "an integer")
    for key in ("rope_scaling", "rope_parameters"):
        rs = d.get(key)
        if rs is None:
            continue
        if not isinstance(rs, dict):
            refuse(key, rs, "null or a dict with rope_type")
        kind = rs.get("rope_type", rs.get("type", "default"))
        if kind not in SUPPORTED_ROPE:
            refuse(f"{key}.rope_type", kind, ", ".join(SUPPORTED_ROPE))
        for k in _ROPE_KEYS.get(kind, ()):
            if not isinstance(rs.get(k), int | float) or isinstance(rs.get(k), bool):
                refuse(f"{key}.{k}", rs.get(k), f"a number (needed by rope_type {kind})")
        if rs.get("partial_rotary_factor", 1.0) != 1.0:
            refuse(f"{key}.partial_rotary_factor", rs["partial_rotary_factor"], "1.0")
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        refuse("partial_rotary_factor", d["partial_rotary_factor"], "1.0")
