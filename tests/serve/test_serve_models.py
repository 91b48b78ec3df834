"""Held-out style checks: Llama variants built by transformers (norm weights 1, weights of
std 0.15, so RoPE, GQA, activation and bias mistakes change the greedy tokens) served
token for token; every unsupported config setting refused with one line, exit 2."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from convergent.cli import main  # noqa: E402
from convergent.core.errors import InputError  # noqa: E402
from convergent.serve.config import ServeConfig  # noqa: E402
from convergent.serve.engine import Engine  # noqa: E402

BASE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
VARIANTS = {
    "gqa_headdim_llama3": (
        "llama",
        dict(
            head_dim=32,
            num_attention_heads=8,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "gelu_bias_tied": (
        "llama",
        dict(
            hidden_act="gelu_pytorch_tanh",
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
        ),
    ),
    "relu_mqa_linear": (
        "llama",
        dict(
            hidden_act="relu",
            num_key_value_heads=1,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
        ),
    ),
    "mistral_window": ("mistral", dict(sliding_window=48, rope_theta=1e6)),
}


def _build(tmp_path, kind, over, seed=0):
    torch.manual_seed(seed)
    if kind == "mistral":
        cfg = transformers.MistralConfig(**{**BASE, **over})
        m = transformers.MistralForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**{**BASE, **over})
        m = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.15)
    m.eval().save_pretrained(tmp_path)
    return m


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_greedy_matches_transformers(tmp_path, variant):
    kind, over = VARIANTS[variant]
    hf = _build(tmp_path, kind, over)
    prompts = [[5, 17, 99, 3, 250], list(range(40, 58))]
    ref = []
    for p in prompts:
        g = hf.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        ref.append(g[0, len(p) :].tolist())
    stages = 2 if variant in ("gelu_bias_tied", "mistral_window") else 1
    cfg = ServeConfig(
        engine={"kv_budget_bytes": 2**20, "block_size": 4},
        scheduler={
            "kind": "interleaved" if stages > 1 else "sequential",
            "stages": stages,
            "profile_costs": False,
        },
    )
    with Engine(tmp_path, cfg, ignore_eos=True) as eng:
        reqs = [eng.add_request(eng.make_request(p, 24)) for p in prompts]
        eng.run()
        if variant == "mistral_window":
            assert eng.context_limit == 48  # within the window, windowed attention is exact
            # the error names the key that set the limit (the window, not the positions)
            with pytest.raises(InputError, match=r"\(sliding_window=48 allows 48,") as e:
                eng.make_request(list(range(40)), 9)
            assert "max_position_embeddings" not in str(e.value)
    assert [r.output for r in reqs] == ref


def _hf_dict(tmp_path):
    d = tmp_path / "m"
    _build(d, "llama", {})
    return d, json.loads((d / "config.json").read_text())


REFUSED = [
    ("model_type", "qwen2"),
    ("architectures", ["GPT2LMHeadModel"]),
    ("hidden_act", "tanh"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}),
    ("attention_bias", "yes"),
    ("mlp_bias", 1),
    ("tie_word_embeddings", "no"),
    ("sliding_window", -4),
    ("quantization_config", {"quant_method": "gptq"}),
    ("final_logit_softcapping", 30.0),
    ("partial_rotary_factor", 0.5),
    ("layer_types", ["chunked_attention"] * 4),
]


def test_unsupported_configs_are_refused(tmp_path, capsys):
    d, base = _hf_dict(tmp_path)
    for key, value in REFUSED:
        cfg = {k: v for k, v in base.items() if k not in ("rope_scaling", "rope_parameters")}
        cfg[key] = value
        (d / "config.json").write_text(json.dumps(cfg))
        rc = main(["generate", "hi", "--model", str(d), "-n", "2"])
        err = capsys.readouterr().err
        assert rc == 2, (key, err)
        line = next((ln for ln in err.splitlines() if ln.startswith("error: ")), "")
        assert line.startswith("error: ") and "config.json" in line and "Traceback" not in err
        shown = key if key != "rope_scaling" else "rope_scaling."
        assert shown in line, line


def test_pytorch_bin_checkpoint_is_refused_before_any_stage(tmp_path, capsys):
    """Weights only as ``pytorch_model.bin`` (a pickle): one line naming the file and the
    conversion, exit 2, from `serve` (before any instance or stage starts) and `generate`."""
    d = tmp_path / "bin"
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE))
    m.config.save_pretrained(d)  # transformers 5 writes safetensors only: the old layout by hand
    torch.save(m.state_dict(), d / "pytorch_model.bin")
    from convergent.serve.executor import free_port

    for argv in (["serve", "--port", str(free_port())], ["generate", "hi", "-n", "2"]):
        rc = main([*argv, "--model", str(d), "--set", f"run.root={tmp_path / 'runs'}"])
        err = capsys.readouterr().err
        line = next((ln for ln in err.splitlines() if ln.startswith("error: ")), "")
        assert rc == 2 and "pytorch_model.bin" in line and "safetensors" in line, err
        assert "save_pretrained" in err and "Traceback" not in err
    with pytest.raises(InputError, match="pytorch_model.bin"):
        Engine(d, ServeConfig(scheduler={"kind": "sequential", "profile_costs": False}))


def test_tiny_vocab_without_tokenizer_is_a_clean_error(tmp_path, capsys):
    d = tmp_path / "tiny"
    _build(d, "llama", {"vocab_size": 100})
    rc = main(["generate", "hi", "--model", str(d), "-n", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "vocab_size=100 < 258" in err and "Traceback" not in err
    # the engine still serves token ids
    with Engine(
        d, ServeConfig(scheduler={"kind": "sequential", "profile_costs": False}), ignore_eos=True
    ) as eng:
        r = eng.add_request(eng.make_request([1, 2, 3], 4))
        eng.run()
    assert len(r.output) == 4 and all(0 <= t < 100 for t in r.output)
