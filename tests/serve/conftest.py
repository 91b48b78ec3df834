"""Shared fixtures: a small random Llama with GQA saved by transformers (HF format)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def hf_llama_dir(tmp_path_factory):
    """A 4-layer random LlamaForCausalLM (4 query / 2 key-value heads) saved by transformers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=256,
        eos_token_id=257,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("hf-llama")
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def hf_greedy():
    """Reference: transformers' greedy generate (EOS disabled) for each prompt."""
    return _hf_greedy


def _hf_greedy(model_dir, prompts, n):
    import torch
    import transformers

    m = transformers.LlamaForCausalLM.from_pretrained(model_dir).eval()
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        g = m.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        out.append(g[0, len(p) :].tolist())
    return out
