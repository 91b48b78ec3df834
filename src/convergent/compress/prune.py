"""Structured pruning of the Llama: whole attention heads and MLP channels, by magnitude.

The pruned model is again a standard Llama (smaller ``intermediate_size`` and
``num_attention_heads``, ``head_dim`` kept explicit), so it is saved in the HF layout,
served by ``convergent serve`` and fine-tuned by ``convergent train`` (``text.init_from``)
like any other. Its speed-up is real on any kernel: the matrices are smaller, not sparse.

Importance (per layer, the same count kept in every layer so the config stays uniform):

* MLP channel ``j``: ``|gate_j| * |up_j| * |down_:,j|`` (row/column L2 norms);
* head ``h``: ``|q_h| * |o_:,h|`` (Frobenius norms of its query rows and output columns),
  plus ``|k_h| * |v_h|`` without GQA. With GQA (fewer key/value heads) whole query
  groups are pruned together with their key/value head.

2:4 semi-structured sparsity is not offered: torch's sparse semi-structured kernels
(cuSPARSELt / CUTLASS) exist on CUDA only, so on this CPU it would save nothing.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from convergent.core.errors import ConfigError
from convergent.core.fsutil import dumps_json

__all__ = ["PruneInfo", "prune_llama", "save_pruned_llama"]


@dataclass
class PruneInfo:
    """What :func:`prune_llama` kept (recorded in the pruned checkpoint's config.json)."""

    method: str = "magnitude-structured"
    mlp_keep: float = 1.0
    heads_keep: float = 1.0
    intermediate_size: tuple[int, int] = (0, 0)  # (before, after)
    kv_heads: tuple[int, int] = (0, 0)
    params: tuple[int, int] = (0, 0)
    kept_channels: dict[str, list[int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("kept_channels")
        return d


def _keep(scores: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(torch.topk(scores, k).indices).values


@torch.no_grad()
def prune_llama(model: Any, mlp_keep: float = 1.0, heads_keep: float = 1.0) -> tuple[Any, PruneInfo]:
    """A new, smaller ``LlamaForCausalLM`` keeping the ``mlp_keep`` fraction of MLP
    channels and ``heads_keep`` of the key/value heads (with their query groups)."""
    from convergent.models.llama import LlamaForCausalLM

    if not (0 < mlp_keep <= 1 and 0 < heads_keep <= 1):
        raise ConfigError(f"mlp_keep={mlp_keep} and heads_keep={heads_keep} must be in (0, 1]")
    c = model.config
    inter = max(1, round(c.intermediate_size * mlp_keep))
    kv = max(1, round(c.num_key_value_heads * heads_keep))
    group = c.num_attention_heads // c.num_key_value_heads
    hd = c.head_dim
    cfg = copy.deepcopy(c)
    cfg.intermediate_size, cfg.num_key_value_heads = inter, kv
    cfg.num_attention_heads, cfg.head_dim = kv * group, hd
    new = LlamaForCausalLM(cfg).eval()
    src, dst = model.state_dict(), new.state_dict()
    info = PruneInfo(mlp_keep=mlp_keep, heads_keep=heads_keep,
                     intermediate_size=(c.intermediate_size, inter),
                     kv_heads=(c.num_key_value_heads, kv))
    for key in dst:
        if ".mlp." not in key and ".self_attn." not in key and key in src:
            dst[key] = src[key].clone()
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        g, u, d = (src[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
        ch = _keep(g.norm(dim=1) * u.norm(dim=1) * d.norm(dim=0), inter)
        info.kept_channels[f"{i}.mlp"] = ch.tolist()
        dst[p + "mlp.gate_proj.weight"], dst[p + "mlp.up_proj.weight"] = g[ch], u[ch]
        dst[p + "mlp.down_proj.weight"] = d[:, ch]
        q, k, v, o = (src[p + f"self_attn.{n}_proj.weight"] for n in ("q", "k", "v", "o"))
        nkv = c.num_key_value_heads
        qh = q.reshape(nkv, group * hd, -1).flatten(1).norm(dim=1)
        oh = o.reshape(o.shape[0], nkv, group * hd).transpose(0, 1).flatten(1).norm(dim=1)
        kh, vh = (t.reshape(nkv, hd, -1).flatten(1).norm(dim=1) for t in (k, v))
        heads = _keep(qh * oh * kh * vh, kv)
        info.kept_channels[f"{i}.heads"] = heads.tolist()
        rows_q = (heads[:, None] * group * hd + torch.arange(group * hd)[None, :]).flatten()
        rows_kv = (heads[:, None] * hd + torch.arange(hd)[None, :]).flatten()
        dst[p + "self_attn.q_proj.weight"] = q[rows_q]
        dst[p + "self_attn.k_proj.weight"], dst[p + "self_attn.v_proj.weight"] = k[rows_kv], v[rows_kv]
        dst[p + "self_attn.o_proj.weight"] = o[:, rows_q]
        for n, rows in (("q", rows_q), ("k", rows_kv), ("v", rows_kv), ("o", None)):
            b = p + f"self_attn.{n}_proj.bias"
            if b in src:
                dst[b] = src[b] if rows is None else src[b][rows]
        for n in ("gate", "up", "down"):
            b = p + f"mlp.{n}_proj.bias"
            if b in src:
                dst[b] = src[b] if n == "down" else src[b][ch]
    new.load_state_dict(dst)
    info.params = (sum(t.numel() for t in model.parameters()), sum(t.numel() for t in new.parameters()))
    return new, info


def save_pruned_llama(model: Any, info: PruneInfo, out: Any, source: Any = None) -> Any:
    """HF checkpoint of a pruned Llama with ``convergent_pruning`` in its config.json and
    the tokenizer files of ``source`` (a plain checkpoint: it loads anywhere)."""
    import json
    from pathlib import Path

    from convergent.core.fsutil import atomic_write_bytes, atomic_write_text
    from convergent.models.llama import save_pretrained

    p = save_pretrained(model, out)
    cfg = json.loads((p / "config.json").read_text(encoding="utf-8"))
    cfg["convergent_pruning"] = info.to_dict()
    if source is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            f = Path(source) / name
            if f.is_file():
                atomic_write_bytes(p / name, f.read_bytes())
    atomic_write_text(p / "config.json", dumps_json(cfg, indent=2))
    return p
