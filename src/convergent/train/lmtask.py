"""Causal language modelling task: a Llama-style decoder on a seeded synthetic stream."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from convergent.core.errors import ConfigError
from convergent.models.llama import LlamaConfig, LlamaForCausalLM, save_pretrained
from convergent.train.taskapi import MicroBatch, Task, stage_layers

if TYPE_CHECKING:
    from convergent.config import ConvergentConfig


def ce_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (fp32) of ``logits`` [..., V] against ``targets``."""
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
    )


class LMTask(Task):
    """Causal language modelling with the Llama decoder of :mod:`convergent.models.llama`.

    Data: a seeded synthetic stream from a sparse random Markov chain over
    ``train.vocab_size`` tokens (each token has 4 likely successors, so the loss falls
    from ln(V) towards ~ln 4). Sequence ``j`` of step ``s`` depends only on
    ``(seed, s, j)``.
    """

    kind = "lm"
    unit = "tokens"
    stat_keys = ("ce_sum", "tokens")
    pipeline_capable = True

    def __init__(self, cfg: ConvergentConfig) -> None:
        super().__init__(cfg)
        t = cfg.train
        self.V = int(t.vocab_size)
        self.S = int(t.seq_len)
        g = torch.Generator().manual_seed(10_007 + t.seed)
        self.succ = torch.randint(0, self.V, (self.V, 4), generator=g)

    def llama_config(self) -> Any:
        m = self.cfg.model
        return LlamaConfig(
            vocab_size=self.V,
            hidden_size=m.hidden,
            intermediate_size=m.mlp_ratio * m.hidden,
            num_hidden_layers=m.layers,
            num_attention_heads=m.heads,
            num_key_value_heads=m.heads,
            max_position_embeddings=max(2 * self.S, 128),
            bos_token_id=None,
            eos_token_id=None,
        )

    def build_model(self, layers: Any = None, embed: bool = True, head: bool = True) -> nn.Module:
        return LlamaForCausalLM(self.llama_config(), layers=layers, embed=embed, head=head)

    def global_seqs(self, dp_world: int, accum: int) -> int:
        t = self.cfg.train
        g = t.global_batch_seqs or t.batch_seqs * dp_world * accum
        if g % (dp_world * accum):
            raise ConfigError(
                f"train.global_batch_seqs={g} is not divisible by ranks x grad_accum "
                f"= {dp_world * accum}"
            )
        return g

    def _sequences(self, stream: int, step: int, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.cfg.train.seed, stream, step)) & 0x7FFFFFFF)
        out = torch.empty(n, self.S + 1, dtype=torch.int64)
        out[:, 0] = torch.randint(0, self.V, (n,), generator=g)
        choice = torch.randint(0, 4, (n, self.S), generator=g)
        noise = torch.rand(n, self.S, generator=g) < 0.1
        rand_tok = torch.randint(0, self.V, (n, self.S), generator=g)
        for i in range(self.S):
            nxt = self.succ[out[:, i], choice[:, i]]
            out[:, i + 1] = torch.where(noise[:, i], rand_tok[:, i], nxt)
        return out

    def micro_batches(self, step: int, dp_rank: int, dp_world: int, accum: int) -> list[MicroBatch]:
        G = self.global_seqs(dp_world, accum)
        seqs = self._sequences(0, step, G)
        parts = dp_world * accum
        per = G // parts
        out = []
        for a in range(accum):
            p = a * dp_world + dp_rank
            chunk = seqs[p * per : (p + 1) * per]
            out.append(
                MicroBatch(
                    data=(chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()),
                    samples=per,
                    units=per * self.S,
                    norm={"tokens": float(G * self.S)},
                )
            )
        return out

    def to(self, mb: MicroBatch, device: torch.device) -> MicroBatch:
        x, y = mb.data
        return MicroBatch((x.to(device), y.to(device)), mb.samples, mb.units, mb.norm)

    def loss_from_logits(self, logits: torch.Tensor, y: torch.Tensor, norm: float) -> torch.Tensor:
        return ce_sum(logits, y) / norm

    def loss(self, model: nn.Module, mb: MicroBatch, dp_world: int) -> tuple[torch.Tensor, dict]:
        x, y = mb.data
        ce = ce_sum(model(x), y)
        loss = ce / mb.norm["tokens"] * dp_world
        return loss, {"ce_sum": ce.detach(), "tokens": torch.tensor(float(mb.units))}

    def finalize_stats(self, sums: dict[str, float]) -> dict[str, float]:
        tokens = max(sums.get("tokens", 0.0), 1.0)
        loss = sums.get("ce_sum", 0.0) / tokens
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}

    def val_batches(self, dp_rank: int, dp_world: int) -> list[MicroBatch]:
        n = max(self.cfg.train.val_max_batches, 1)
        out = []
        for i in range(dp_rank, n, dp_world):
            seqs = self._sequences(1, i, self.cfg.train.batch_seqs)
            out.append(
                MicroBatch(
                    (seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()),
                    len(seqs),
                    len(seqs) * self.S,
                    {"tokens": 1.0},
                )
            )
        return out

    def val_stats(self, model: nn.Module, mb: MicroBatch) -> dict[str, torch.Tensor]:
        x, y = mb.data
        with torch.no_grad():
            ce = ce_sum(model(x), y)
        return {"ce_sum": ce, "tokens": torch.tensor(float(mb.units))}

    def export(self, model: nn.Module, directory: Any) -> None:
        save_pretrained(model, directory)

    # pipeline support: a stage is a LlamaForCausalLM holding a slice of layers
    def stage_module(self, full: nn.Module, stage: int, n_stages: int) -> nn.Module:
        layers = stage_layers(self.cfg.model.layers, stage, n_stages)
        mod = self.build_model(layers=layers, embed=stage == 0, head=stage == n_stages - 1)
        own = mod.state_dict()
        src = full.state_dict()
        mod.load_state_dict({k: src[k] for k in own})
        return mod

    def pipeline_rounds(
        self, mb: MicroBatch, state: dict[str, Any], training: bool
    ) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
        state.clear()
        state.update(norm=mb.norm["tokens"])
        x, y = mb.data
        return [((x,), y)]

    def pipeline_loss(self, output: Any, target: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        return self.loss_from_logits(output, target, state["norm"])

    def pipeline_sums(
        self, state: dict[str, Any], mb: MicroBatch, last: bool, losses: list[torch.Tensor]
    ) -> dict[str, float]:
        done = float(last)
        ce_sum = sum(float(v) for v in losses) * state["norm"]
        return {"ce_sum": ce_sum * done, "tokens": mb.units * done,
                "samples": mb.samples * done, "units": mb.units * done}
