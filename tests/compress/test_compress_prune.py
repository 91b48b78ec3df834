"""Structured pruning of the Llama (heads, MLP channels) and its recovery fine-tune
through the training engine (``text.init_from``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from convergent.compress.prune import prune_llama, save_pruned_llama
from convergent.core.errors import ConfigError
from convergent.models.llama import LlamaConfig, LlamaForCausalLM, load_pretrained


def test_keep_all_is_the_identity_and_pruned_shapes_are_a_smaller_llama(tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.tiny()).eval()  # GQA: 4 query heads, 2 kv heads
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids)
        same, _ = prune_llama(model, 1.0, 1.0)
        assert torch.equal(same(ids), ref)
    small, info = prune_llama(model, mlp_keep=0.5, heads_keep=0.5)
    c = small.config
    assert (c.intermediate_size, c.num_key_value_heads, c.num_attention_heads, c.head_dim) == (64, 1, 2, 16)
    lay = small.model.layers["0"]
    assert lay.mlp.gate_proj.weight.shape == (64, 64) and lay.mlp.down_proj.weight.shape == (64, 64)
    assert lay.self_attn.q_proj.weight.shape == (32, 64) and lay.self_attn.k_proj.weight.shape == (16, 64)
    assert info.params[1] < info.params[0]
    # kept channels are the largest by the magnitude score, rows copied unchanged
    src = model.model.layers["0"].mlp
    kept = info.kept_channels["0.mlp"]
    assert torch.equal(lay.mlp.up_proj.weight, src.up_proj.weight[kept])
    with torch.no_grad():
        score = src.gate_proj.weight.norm(dim=1) * src.up_proj.weight.norm(dim=1) * src.down_proj.weight.norm(dim=0)
    assert float(score[kept].min()) >= float(score[[j for j in range(128) if j not in kept]].max())
    out = save_pruned_llama(small, info, tmp_path / "pruned")
    back = load_pretrained(out)
    with torch.no_grad():
        assert torch.equal(back(ids), small(ids))
    assert json.loads((out / "config.json").read_text())["convergent_pruning"]["mlp_keep"] == 0.5
    with pytest.raises(ConfigError):
        prune_llama(model, mlp_keep=0.0)


def test_pruned_text_lm_recovers_through_the_trainer(tmp_path):
    from tests.train.trainhelpers import run_training

    base = [
        "text.source=stdlib", "text.max_files=24", "text.vocab_size=300",
        f"text.cache_dir={tmp_path / 'cache'}", "train.device=cpu", "model.kind=llama",
        "model.hidden=32", "model.layers=2", "model.heads=2", "train.seq_len=32",
        "train.global_batch_seqs=8", "train.val_every=0", "train.val_max_batches=2",
        "train.warmup_steps=2", "train.lr=3e-3", "checkpoint.interval=0",
        "metrics.tensorboard=false", "parallel.strategy=single",
    ]
    res, recs, _ = run_training(tmp_path, [*base, "train.steps=30"], 1, "dense")
    dense = load_pretrained(res.final_dir)
    small, info = prune_llama(dense, mlp_keep=0.5, heads_keep=0.5)
    pruned = save_pruned_llama(small, info, tmp_path / "pruned", source=res.final_dir)
    res2, recs2, _ = run_training(
        tmp_path, [*base, "train.steps=8", f"text.init_from={pruned}"], 1, "recover"
    )
    # it started from the pruned weights (far below a fresh model's ~ln 300), and recovered
    assert recs2[0].loss < math.log(300) - 0.5
    assert recs2[-1].loss < recs2[0].loss
    cfg = json.loads((Path(res2.final_dir) / "config.json").read_text())
    assert cfg["intermediate_size"] == 32 and cfg["num_attention_heads"] == 1
    assert cfg["convergent_init_from"]["convergent_pruning"]["heads_keep"] == 0.5
    assert (Path(res2.final_dir) / "tokenizer.json").is_file()
