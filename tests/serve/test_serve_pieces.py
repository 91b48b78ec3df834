"""Mixed steps (prefills and decodes together) through the piecewise runner: each layer's
dense work in static buffers padded to token buckets (CUDA graphs on the GPU), attention
eager between the pieces. On the CPU the static path runs without capture and must equal
the eager forward (fp32) with the KV cache written the same; the ``gpu`` test captures
the pieces and compares a replayed step with the eager one."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from convergent.models.paged_pieces import token_buckets  # noqa: E402
from tests.serve.graph_cases import (  # noqa: E402
    eager_logits,
    make_runner,
    mixed_logits,
    mixed_meta,
    prefill,
)

PROMPTS = [[256, 72, 105, 33], [256] + list(range(60, 90)), [256, 7]]
NEW = [256] + list(range(10, 23))  # 14 tokens


def test_token_buckets():
    assert token_buckets(8192)[:7] == [16, 32, 64, 128, 256, 512, 1024]
    assert token_buckets(8192)[-2:] == [7680, 8192] and len(token_buckets(8192)) == 21
    assert token_buckets(1000) == [16, 32, 64, 128, 256, 512, 1000]
    assert token_buckets(10) == [10]
    with pytest.raises(ValueError):
        token_buckets(0)


def _step(runner):
    toks, lens = prefill(runner, PROMPTS)
    return mixed_meta(toks, lens, NEW)


@pytest.mark.numerics
def test_piecewise_mixed_step_equals_eager_fp32(hf_llama_dir):
    """3 decodes + a 14-token prompt (17 tokens, padded to 32): the static pieces' logits
    equal the eager forward's within fp32 rounding, and the KV cache holds the same keys
    and values afterwards (the same slots written, nothing else)."""
    runner = make_runner(hf_llama_dir)
    m = runner.mixed
    assert m is not None and not m.captured and m.buckets[-1] == 1024
    meta = _step(runner)
    assert m.bucket(len(meta.positions)) == 32
    before = [(k.clone(), v.clone()) for k, v in runner.kv.layers]
    ref = eager_logits(runner, meta)
    after_eager = [(k.clone(), v.clone()) for k, v in runner.kv.layers]
    runs = m.static_runs
    got = mixed_logits(runner, meta)
    assert m.static_runs == runs + 1 and got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()
    for (k0, v0), (k1, v1) in zip(after_eager, runner.kv.layers, strict=True):
        torch.testing.assert_close(k1, k0, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v1, v0, atol=1e-5, rtol=1e-5)
    changed = [not torch.equal(b[0], a[0]) for b, a in zip(before, after_eager, strict=True)]
    assert all(changed)  # the step wrote its new tokens' keys in every layer


def test_engine_prefill_steps_take_the_pieces(hf_llama_dir):
    """With cuda_graphs=on (the static path on the CPU) a prefill step runs through the
    piecewise runner, and one past its largest bucket stays eager."""
    runner = make_runner(hf_llama_dir)
    prefill(runner, PROMPTS)
    assert runner.mixed.static_runs == 1
    off = make_runner(hf_llama_dir, mode="off")
    assert off.mixed is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_piecewise_replay_equals_eager_on_cuda(hf_llama_dir, dtype):
    """Captured at start-up (every bucket, every piece); a replayed mixed step's logits
    equal the eager step's (fp32: float32 rounding; bf16: the teacher-forced tolerance)."""
    from tests.serve.test_serve_dtype import logit_tol

    runner = make_runner(hf_llama_dir, backend="triton", device="cuda", dtype=dtype,
                         mode="auto")
    m = runner.mixed
    assert m is not None and m.captured
    assert len(m._graphs) == len(m.buckets) * (len(m.layers) + 1)
    meta = _step(runner)
    ref = eager_logits(runner, meta)
    got = mixed_logits(runner, meta)
    assert m.replays >= 2  # the prefill of _step and this step
    if dtype == "float32":
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()
    else:
        assert float((got - ref).abs().max()) <= logit_tol(torch.bfloat16, ref.cpu())


@pytest.mark.numerics
def test_two_stages_through_the_pieces_equal_eager(hf_llama_dir):
    """A pipeline of two in-process stages with the pieces (the second takes hidden states
    into the static residual stream) gives the eager pipeline's tokens, greedy and seeded,
    over a prefill step and a mixed step."""
    from convergent.serve.config import EngineConfig
    from convergent.serve.executor import LocalExecutor
    from convergent.serve.stage import StageSpec
    from tests.serve.graph_cases import _meta

    def tokens(mode):
        eng = EngineConfig(block_size=4, max_model_len=32, cuda_graphs=mode)
        ex = LocalExecutor([StageSpec(str(hf_llama_dir), s, 2, 72, eng) for s in range(2)])
        runners = ex.runners
        assert all((r.mixed is not None) == (mode == "on") for r in runners)
        out = []
        for meta in (_meta(0, [(i, p, 0) for i, p in enumerate(PROMPTS)]),
                     _meta(1, [(len(PROMPTS), NEW, 0)])):
            with torch.inference_mode():
                h = runners[0].run(meta)
                out.append(runners[1].run(meta, h).tokens)
        if mode == "on":
            assert [r.mixed.static_runs for r in runners] == [2, 2]
        ex.close()
        return out

    assert tokens("on") == tokens("off")
