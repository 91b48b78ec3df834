"""Decode steps through static buffers padded to batch-size buckets (CUDA graphs on the GPU):
the padded static path equals the eager path (fp32, a bucket with padding rows), padding
rows never write a real KV block, the engine's tokens are transformers' with graphs on,
and async scheduling keeps the tokens and the order of the token events. The ``gpu``
tests capture the graphs: replay equals eager, bf16 within its tolerance, no host sync
in a replay."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from convergent.core.errors import ConfigError  # noqa: E402
from convergent.models.paged_graphs import decode_buckets  # noqa: E402
from convergent.serve.config import EngineConfig, ServeConfig  # noqa: E402
from convergent.serve.engine import Engine  # noqa: E402
from convergent.serve.graphs import graph_mode  # noqa: E402
from convergent.serve.sampling import RowParams, SamplingParams, sample_device  # noqa: E402
from tests.serve.graph_cases import (  # noqa: E402
    BS,
    NUM_BLOCKS,
    decode_meta,
    eager_logits,
    make_runner,
    prefill,
    static_logits,
)

PROMPTS = [[256, 72, 105, 33], [256] + list(range(60, 90)), [256, 7], [256, 9, 9], [256, 5]]
_CUDA = [pytest.mark.gpu,
         pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")]


def test_buckets_are_powers_then_multiples_of_16():
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(50) == [1, 2, 4, 8, 16, 32, 48, 50]
    assert decode_buckets(256)[-3:] == [224, 240, 256]


def test_graph_mode_by_setting_device_and_backend():
    def mode(setting, device="cpu", backend="triton", dynamic=False):
        return graph_mode(EngineConfig(cuda_graphs=setting), device, backend, dynamic)

    assert mode("auto") == "off" and mode("off", "cuda") == "off"
    assert mode("auto", "cuda") == "capture" and mode("auto", "cuda", "sdpa_gather") == "capture"
    assert mode("on") == "static"  # the CPU check of the padded path
    assert mode("auto", "cuda", "flex") == "off" and mode("auto", "cuda", dynamic=True) == "off"
    with pytest.raises(ConfigError, match="cuda_graphs=on"):
        mode("on", "cuda", "flex")
    with pytest.raises(ConfigError, match="dynamic"):
        mode("on", dynamic=True)


@pytest.mark.numerics
@pytest.mark.parametrize("n", [3, 1, 8], ids=["padded-3-of-4", "bucket-1", "full-8"])
def test_padded_static_decode_equals_eager_fp32(hf_llama_dir, n):
    """One decode step of ``n`` sequences: the padded static path's logits equal the eager
    path's (fp32), the same greedy tokens; real KV blocks other than the step's own slots
    are untouched (the padding rows write the scratch block only)."""
    runner = make_runner(hf_llama_dir)
    g = runner.graphs
    assert g is not None and not g.captured and g.shape.scratch_block == NUM_BLOCKS
    assert runner.kv.layers[0][0].shape[0] == (NUM_BLOCKS + 1) * BS  # one scratch block
    prompts = (PROMPTS * 2)[:n]
    toks, lens = prefill(runner, prompts)
    meta = decode_meta(toks, lens)
    assert g.fits(meta.query_lens, meta.context_lens, meta.sample_rows)
    ref = eager_logits(runner, meta)
    before = [(k.clone(), v.clone()) for k, v in runner.kv.layers]
    got = static_logits(runner, meta)
    assert g.static_runs == 1 and got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()
    real = torch.ones(NUM_BLOCKS * BS, dtype=torch.bool)
    real[meta.slots] = False  # the step's own slots: rewritten with the same new K/V
    for (k0, v0), (k1, v1) in zip(before, runner.kv.layers, strict=True):
        assert torch.equal(k0[:NUM_BLOCKS * BS][real], k1[:NUM_BLOCKS * BS][real])
        assert torch.equal(v0[:NUM_BLOCKS * BS][real], v1[:NUM_BLOCKS * BS][real])
        torch.testing.assert_close(k1[meta.slots], k0[meta.slots], atol=1e-5, rtol=1e-5)
    if n < g.bucket(n):  # the padding rows wrote the scratch block
        assert not torch.equal(before[0][0][NUM_BLOCKS * BS:], runner.kv.layers[0][0][NUM_BLOCKS * BS:])


def test_mixed_or_too_large_steps_stay_eager(hf_llama_dir):
    runner = make_runner(hf_llama_dir, max_num_seqs=2)
    g = runner.graphs
    assert g.buckets == [1, 2]
    assert not g.fits([1, 1, 1], [5, 6, 7], [0, 1, 2])  # more than the largest bucket
    assert not g.fits([1, 3], [5, 3], [0, 3])  # a prefill in the step
    assert not g.fits([1], [1], [0])  # a one-token prompt is a prefill in the eager plan
    assert not g.fits([1], [BS * 8 + 1], [0])  # longer than the static block table


def _serve(model_dir, prompts, n, **engine):
    cfg = ServeConfig(engine={"kv_budget_bytes": 2**20, "block_size": 4, "max_model_len": 128,
                              **engine},
                      scheduler={"kind": "sequential", "profile_costs": False, "max_num_seqs": 8})
    events = []
    with Engine(model_dir, cfg, ignore_eos=True) as eng:
        eng.add_token_listener(events.append)
        sampling = [SamplingParams(), SamplingParams(temperature=0.9, top_k=20, top_p=0.8, seed=3)]
        reqs = [eng.add_request(eng.make_request(p, n, sampling=sampling[i % 2]))
                for i, p in enumerate(prompts)]
        eng.run()
        g = eng.executor.runners[0].graphs
        runs = (g.static_runs + g.replays) if g is not None else 0
        assert eng.summary()["decode_graph_steps"] == runs
    return [r.output for r in reqs], events, runs


def test_engine_with_static_decode_and_async_scheduling_keeps_tokens(hf_llama_dir, hf_greedy):
    """fp32 end to end: graphs on (the static path on the CPU) and async scheduling on give
    the eager engine's tokens (greedy: transformers'; seeded draws: the same draws) and the
    same token events in the same order."""
    ref_out, ref_events, runs = _serve(hf_llama_dir, PROMPTS, 10, cuda_graphs="off",
                                       async_scheduling="off")
    assert runs == 0
    greedy = hf_greedy(hf_llama_dir, PROMPTS[::2], 10)
    assert ref_out[::2] == greedy
    for mode, asyn in [("on", "off"), ("off", "on"), ("on", "on")]:
        out, events, runs = _serve(hf_llama_dir, PROMPTS, 10, cuda_graphs=mode,
                                   async_scheduling=asyn)
        assert out == ref_out, (mode, asyn)
        assert events == ref_events, (mode, asyn)
        assert (runs > 0) == (mode == "on")


# -- on the GPU: captured graphs
@pytest.mark.parametrize("backend", ["triton", "sdpa_gather"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [3, 8])
def test_graph_replay_equals_eager_on_cuda(hf_llama_dir, backend, dtype, n):
    """Captured at start-up; a replay's logits equal the eager step's (fp32: float32
    rounding; bf16: the teacher-forced tolerance of test_serve_dtype), and a replay and
    the device sampler run with no host synchronisation (sync debug mode "error")."""
    if backend == "triton":
        pytest.importorskip("triton")
    from tests.serve.test_serve_dtype import logit_tol

    runner = make_runner(hf_llama_dir, backend=backend, device="cuda", dtype=dtype, mode="auto")
    g = runner.graphs
    assert g is not None and g.captured and sorted(g._graphs) == g.buckets
    toks, lens = prefill(runner, (PROMPTS * 2)[:n])
    meta = decode_meta(toks, lens)
    ref = eager_logits(runner, meta)
    got = static_logits(runner, meta)
    assert g.replays == 1
    if dtype == "float32":
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()
    else:
        tol = logit_tol(torch.bfloat16, ref.cpu())
        assert float((got - ref).abs().max()) <= tol
    rows = RowParams()
    for i in range(n):  # greedy and seeded rows: the sampler stays on the device too
        rows.add(SamplingParams(temperature=0.7 * (i % 2), top_k=5, top_p=0.9, seed=i), lens[i])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        g._graphs[g.bucket(n)].replay()
        sample_device(g._out[g.bucket(n)][:n], rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


for _m in _CUDA:
    test_graph_replay_equals_eager_on_cuda = _m(test_graph_replay_equals_eager_on_cuda)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
def test_engine_graphs_and_async_on_cuda_equal_eager_fp32(hf_llama_dir, hf_greedy):
    """fp32 on the GPU: graphs and async scheduling (auto: both on) give the eager,
    synchronous engine's tokens, greedy rows transformers'."""
    ref_out, ref_events, _ = _serve(hf_llama_dir, PROMPTS, 16, device="cuda", cuda_graphs="off",
                                    async_scheduling="off")
    out, events, runs = _serve(hf_llama_dir, PROMPTS, 16, device="cuda")
    assert runs > 0
    assert out == ref_out and events == ref_events
    assert ref_out[::2] == hf_greedy(hf_llama_dir, PROMPTS[::2], 16)
