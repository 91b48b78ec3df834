"""Causal language modelling on a real text corpus (``model.kind: llama`` + ``text.source``).

The corpus, its byte-level BPE tokenizer and its token streams come from
:mod:`convergent.data.textcorpus` (rank 0 prepares them once in the cache; the other ranks
wait at a barrier and load them). The model is :class:`~convergent.models.llama.LlamaForCausalLM`
with the tokenizer's vocabulary and ``<|endoftext|>`` as its EOS, so the export in
``ckpt/final`` (HF layout + ``tokenizer.json``) is what ``convergent serve`` serves as text.

Batches follow the global plan of :mod:`convergent.train.tasks`: the ``G`` sequences of
step ``s`` are windows of ``seq_len + 1`` tokens at offsets drawn from ``(seed, s)``
alone, so any world size sees the same data. Validation uses fixed, evenly spaced
windows of the held-out files (``val_max_batches x batch_seqs`` of them); the reported
``perplexity`` of the ``val`` records is the validation perplexity per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from convergent.compress.distill import kd_loss
from convergent.core.fsutil import dumps_json
from convergent.train.lmtask import LMTask
from convergent.train.taskapi import MicroBatch, Task

if TYPE_CHECKING:
    from convergent.config import ConvergentConfig


__all__ = ["TextLMTask", "load_corpus"]


def load_corpus(cfg: ConvergentConfig) -> Any:
    """The prepared corpus of ``cfg.text``: built by rank 0, loaded by every rank."""
    from convergent.data.textcorpus import prepare_corpus

    rank = dist.get_rank() if dist.is_initialized() else 0
    err: BaseException | None = None
    if rank == 0:
        try:
            prepare_corpus(cfg.text, cfg.run.root)
        except BaseException as exc:  # let the other ranks leave the barrier first
            err = exc
    if dist.is_initialized():
        dist.barrier()
    if err is not None:
        raise err
    return prepare_corpus(cfg.text, cfg.run.root, build=False)


class TextLMTask(LMTask):
    """LMTask on the token streams of a text corpus (see the module doc)."""

    def __init__(self, cfg: ConvergentConfig) -> None:
        Task.__init__(self, cfg)
        self.corpus = load_corpus(cfg)
        self.V = int(self.corpus.vocab_size)
        self.S = int(cfg.train.seq_len)
        self.train_ids = torch.from_numpy(self.corpus.train.astype(np.int64))
        self.val_ids = torch.from_numpy(self.corpus.val.astype(np.int64))
        if self.train_ids.numel() <= self.S + 1 or self.val_ids.numel() <= self.S + 1:
            from convergent.core.errors import ConfigError

            raise ConfigError(
                f"train.seq_len={self.S}: the corpus has only {self.train_ids.numel()} train / "
                f"{self.val_ids.numel()} validation tokens",
                hint="lower train.seq_len or use more files (text.max_files)",
            )

    def _teacher_model(self) -> nn.Module | None:
        """The distillation teacher (loaded once per rank, frozen), or None."""
        t = self.cfg.text.teacher
        if not t:
            return None
        if getattr(self, "_teacher", None) is None:
            from convergent.core.errors import ConfigError
            from convergent.models.llama import load_pretrained

            if self.cfg.parallel.strategy == "pipeline":
                raise ConfigError("text.teacher (distillation) runs with ddp/fsdp/single, not pipeline")
            model = load_pretrained(t).eval().requires_grad_(False)
            if model.config.vocab_size != self.V:
                raise ConfigError(f"text.teacher: {t} has vocab_size={model.config.vocab_size}, "
                                  f"the corpus tokenizer {self.V}")
            self._teacher = model
        return self._teacher

    def loss(self, model: nn.Module, mb: MicroBatch, dp_world: int) -> tuple[torch.Tensor, dict]:
        """CE to the next tokens, mixed with the teacher's softened distribution when
        ``text.teacher`` is set (reported statistics stay the CE, so ``perplexity`` is
        the student's own)."""
        teacher = self._teacher_model()
        if teacher is None:
            return super().loss(model, mb, dp_world)
        x, y = mb.data
        logits = model(x)
        teacher.to(x.device)
        with torch.no_grad():
            t_logits = teacher(x)
        loss, ce = kd_loss(logits, t_logits, y, self.cfg.text.kd_temperature, self.cfg.text.kd_alpha)
        return loss / mb.norm["tokens"] * dp_world, {"ce_sum": ce.detach(),
                                                     "tokens": torch.tensor(float(mb.units))}

    def llama_config(self) -> Any:
        init = self.cfg.text.init_from
        if init:  # the architecture of the starting checkpoint (e.g. a pruned model)
            from convergent.models.llama import read_config

            cfg = read_config(init)
            if cfg.vocab_size != self.V:
                from convergent.core.errors import ConfigError

                raise ConfigError(f"text.init_from: {init} has vocab_size={cfg.vocab_size}, "
                                  f"the corpus tokenizer {self.V}")
        else:
            cfg = super().llama_config()
        cfg.eos_token_id = int(self.corpus.eot_id)
        return cfg

    def build_model(self, layers: Any = None, embed: bool = True, head: bool = True) -> nn.Module:
        model = super().build_model(layers, embed, head)
        if self.cfg.text.init_from:
            from convergent.models.llama import load_pretrained

            full = load_pretrained(self.cfg.text.init_from, layers, embed, head).state_dict()
            model.load_state_dict({k: full[k] for k in model.state_dict()})
        return model

    def _windows(self, ids: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        offs = torch.arange(self.S + 1)
        return ids[starts[:, None] + offs[None, :]]

    def _sequences(self, stream: int, step: int, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(
            (int(self.cfg.train.seed) * 1_000_003 + step * 7 + stream) & 0x7FFFFFFF
        )
        hi = self.train_ids.numel() - self.S - 1
        return self._windows(self.train_ids, torch.randint(0, hi, (n,), generator=g))

    def val_batches(self, dp_rank: int, dp_world: int) -> list[MicroBatch]:
        t = self.cfg.train
        n_batches = max(t.val_max_batches, 1)
        n = n_batches * t.batch_seqs
        hi = self.val_ids.numel() - self.S - 1
        starts = torch.linspace(0, hi, n).long()
        seqs = self._windows(self.val_ids, starts)
        out = []
        for i in range(dp_rank, n_batches, dp_world):
            chunk = seqs[i * t.batch_seqs : (i + 1) * t.batch_seqs]
            out.append(MicroBatch(
                (chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()),
                len(chunk), len(chunk) * self.S, {"tokens": 1.0},
            ))
        return out

    def export(self, model: nn.Module, directory: Any) -> None:
        """HF checkpoint + the corpus's ``tokenizer.json`` / ``tokenizer_config.json``."""
        from pathlib import Path

        from convergent.core.fsutil import atomic_write_bytes

        super().export(model, directory)
        for f in self.corpus.tokenizer_files:
            atomic_write_bytes(Path(directory) / f.name, f.read_bytes())
        if self.cfg.text.init_from:  # keep the record of how the start was made (pruning)
            import json

            from convergent.core.fsutil import atomic_write_text

            start = json.loads((Path(self.cfg.text.init_from) / "config.json").read_text())
            out = json.loads((Path(directory) / "config.json").read_text())
            out["convergent_init_from"] = {"path": str(self.cfg.text.init_from),
                                           **{k: v for k, v in start.items()
                                              if k.startswith("convergent_pruning")}}
            atomic_write_text(Path(directory) / "config.json", dumps_json(out, indent=2))
