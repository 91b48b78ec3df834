"""The Llama decoder against transformers' LlamaForCausalLM on the same weights."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from convergent.models.llama import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    load_pretrained,
    save_pretrained,
)
from convergent.serve.config import ServeConfig  # noqa: E402
from convergent.serve.engine import Engine  # noqa: E402

ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}


def _hf_model(tmp_path, rope, mpe=32):
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=mpe,
        rope_scaling=rope,
        initializer_range=0.2,
    )
    m = transformers.LlamaForCausalLM(cfg).eval()
    m.save_pretrained(tmp_path)
    return m


@pytest.mark.numerics
@pytest.mark.parametrize("rope", list(ROPES))
def test_logits_match_transformers(tmp_path, rope):
    hf = _hf_model(tmp_path, ROPES[rope])
    ours = load_pretrained(tmp_path)
    ids = torch.randint(0, 300, (2, 24))  # longer than max_position_embeddings=... for scaling
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)
    assert got.shape == (2, 24, 300)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.numerics
@pytest.mark.parametrize("rope", list(ROPES))
def test_greedy_paged_matches_transformers_generate(tmp_path, rope, hf_greedy):
    """Paged-KV greedy decoding through the engine equals HF generate token for token;
    generation runs past the unscaled max_position_embeddings (32) of linear and dynamic
    RoPE (their context limit is 32 x factor), and past llama3's
    original_max_position_embeddings (16); default and llama3 get 64 positions, their
    context limit."""
    _hf_model(tmp_path, ROPES[rope], mpe=32 if rope in ("linear", "dynamic") else 64)
    prompts = [[5, 17, 99, 3], list(range(40, 60)), [250]]
    ref = hf_greedy(tmp_path, prompts, 30)
    cfg = ServeConfig(
        engine={"kv_budget_bytes": 2**20, "block_size": 4},
        scheduler={"kind": "sequential", "profile_costs": False},
    )
    with Engine(tmp_path, cfg, ignore_eos=True) as eng:
        reqs = [eng.add_request(eng.make_request(p, 30)) for p in prompts]
        eng.run()
    assert [r.output for r in reqs] == ref


@pytest.mark.numerics
def test_gqa_checkpoint_from_transformers_greedy(hf_llama_dir, hf_greedy):
    prompts = [[256, 72, 105], [256] + list(range(60, 100))]
    ref = hf_greedy(hf_llama_dir, prompts, 24)
    m = load_pretrained(hf_llama_dir)
    assert m.config.num_key_value_heads == 2 and m.config.num_attention_heads == 4
    assert [m.generate_greedy(p, 24) for p in prompts] == ref


def test_training_forward_and_backward():
    cfg = LlamaConfig.tiny()
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 11))
    logits = model(ids)
    assert logits.shape == (3, 11, cfg.vocab_size)
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1)
    )
    loss.backward()
    assert model.model.layers["0"].self_attn.q_proj.weight.grad is not None
    # causal: changing a later token leaves earlier logits unchanged
    ids2 = ids.clone()
    ids2[:, -1] = (ids2[:, -1] + 1) % cfg.vocab_size
    with torch.no_grad():
        assert torch.allclose(model(ids)[:, :-1], model(ids2)[:, :-1], atol=1e-6)
    assert abs(cfg.n_params - sum(p.numel() for p in model.parameters())) == 0


def test_save_load_roundtrip_readable_by_transformers(tmp_path):
    cfg = LlamaConfig.tiny(
        tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0}
    )
    model = LlamaForCausalLM(cfg)
    model.reset_parameters(std=0.2, seed=3)
    save_pretrained(model, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    back = load_pretrained(tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (1, 9))
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, model(ids), atol=1e-4)
        assert torch.allclose(back(ids), model(ids), atol=1e-6)


def test_stage_slices_load_only_their_layers(hf_llama_dir):
    first = load_pretrained(hf_llama_dir, layers=[0, 1], embed=True, head=False)
    last = load_pretrained(hf_llama_dir, layers=[2, 3], embed=False, head=True)
    full = load_pretrained(hf_llama_dir)
    assert set(first.model.layers) == {"0", "1"} and first.lm_head is None
    assert last.model.embed_tokens is None and last.lm_head is not None
    ids = torch.randint(0, 320, (1, 7))
    with torch.no_grad():
        assert torch.allclose(last(first(ids)), full(ids), atol=1e-5)


def test_loaded_weights_do_not_keep_the_checkpoint_mapped(hf_llama_dir):
    """Every loaded tensor is a copy of its own: once loaded, no page of the checkpoint
    file stays mapped (a tensor of safetensors' mapping keeps all of it resident, and a
    serving stage that drops its plain weights would hold the checkpoint twice)."""
    from pathlib import Path

    maps = Path("/proc/self/maps")
    if not maps.is_file():
        pytest.skip("needs /proc/self/maps (Linux)")
    files = {str(f.resolve()) for f in Path(hf_llama_dir).glob("*.safetensors")}
    model = load_pretrained(hf_llama_dir)
    mapped = {line.split()[-1] for line in maps.read_text().splitlines() if len(line.split()) >= 6}
    assert model.lm_head.weight.numel() and not files & mapped
