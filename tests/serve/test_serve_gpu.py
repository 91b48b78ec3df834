"""Serving on a CUDA GPU against transformers on the same device and dtype (marked
``gpu``; skipped with the reason where CUDA is absent)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from convergent.serve.config import ServeConfig  # noqa: E402
from convergent.serve.engine import Engine  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)"),
]

PROMPTS = [[256, 72, 105, 33], [256] + list(range(60, 90)), [256, 7]]
N_NEW = 32


def _hf_generate(model_dir, name):
    m = transformers.LlamaForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, name)).to("cuda").eval()
    out = []
    for p in PROMPTS:
        ids = torch.tensor([p], device="cuda")
        g = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW,
                       do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(g[0, len(p):].tolist())
    return m, out


def test_gpu_serving_matches_transformers_float32(hf_llama_dir):
    """float32 on the GPU: token for token. (bf16/fp16 on the GPU are compared teacher-forced,
    within a tolerance in ulps of the dtype, by tests/serve/test_serve_dtype.py's cuda
    parameters: free-running agreement counts near ties, not the engine.)"""
    _, ref = _hf_generate(hf_llama_dir, "float32")
    cfg = ServeConfig(
        engine={"kv_budget_bytes": 2**20, "block_size": 4, "dtype": "float32", "device": "cuda"},
        scheduler={"kind": "sequential", "profile_costs": False},
    )
    with Engine(hf_llama_dir, cfg, ignore_eos=True) as eng:
        reqs = [eng.add_request(eng.make_request(p, N_NEW)) for p in PROMPTS]
        eng.run()
    assert [r.output for r in reqs] == ref


def test_two_stages_on_one_gpu_is_refused_with_the_fix(hf_llama_dir):
    from convergent.core.errors import ConfigError

    n = torch.cuda.device_count()
    cfg = ServeConfig(
        engine={"device": "cuda", "kv_budget_bytes": 2**20, "block_size": 4},
        scheduler={"kind": "tdpipe", "stages": n + 1, "profile_costs": False},
    )
    if n + 1 > 4:  # the test model has 4 layers
        pytest.skip("more than 3 GPUs: cannot ask for more stages than GPUs on this model")
    with pytest.raises(ConfigError, match=r"serve\.scheduler\.stages"):
        Engine(hf_llama_dir, cfg)


def test_serving_attention_never_takes_cudnn(hf_llama_dir):
    """cuDNN's SDPA builds a graph per shape, and serving's shapes change every step: on an
    H100 it cost 1.18 ms of host time per call (docs/gpu-notes.md). The serving forward
    limits SDPA to FlashAttention / memory-efficient / math; prefills and masked decode
    groups both run, and none of them is cuDNN's."""
    from torch.profiler import ProfilerActivity, profile

    cfg = ServeConfig(
        engine={"kv_budget_bytes": 2**20, "block_size": 4, "dtype": "bfloat16", "device": "cuda"},
        scheduler={"kind": "sequential", "profile_costs": False},
    )
    with Engine(hf_llama_dir, cfg, ignore_eos=True) as eng:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            reqs = [eng.add_request(eng.make_request(p, 8)) for p in PROMPTS]
            eng.run()
    assert all(len(r.output) == 8 for r in reqs)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::scaled_dot_product_attention" in ops, sorted(ops)[:50]
    assert not [o for o in ops if "cudnn_attention" in o], sorted(ops)
