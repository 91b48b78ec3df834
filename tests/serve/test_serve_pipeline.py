"""Real stage processes (gloo, point-to-point activations): outputs equal transformers'
greedy decoding and are identical across the three schedulers, under a KV budget tight
enough to force preemption by recompute."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from convergent.serve.config import ServeConfig  # noqa: E402
from convergent.serve.costs import CostTable  # noqa: E402
from convergent.serve.engine import Engine  # noqa: E402

COSTS = CostTable([2e-3, 2e-4, 1e-7, 5e-6], [1e-3, 2e-4], 1e-4, 0.0, [2, 2], "test")


def test_three_schedulers_identical_and_match_transformers(hf_llama_dir, hf_greedy):
    import random

    rng = random.Random(0)
    prompts = [[256] + [rng.randrange(256) for _ in range(rng.randint(2, 40))] for _ in range(10)]
    n_new = 24
    ref = hf_greedy(hf_llama_dir, prompts, n_new)
    # KV budget: 4 layers * 2 kv heads * 16 dims * 2 (K,V) * 4 bytes = 1 KiB per token
    budget = 160 * 1024  # 160 tokens of KV for ~10 requests of up to 65 tokens
    outs, summaries = {}, {}
    for name, chunked in (
        ("sequential", False),
        ("interleaved", False),
        ("interleaved", True),
        ("tdpipe", False),
    ):
        cfg = ServeConfig(
            engine={"kv_budget_bytes": budget, "block_size": 4},
            scheduler={
                "kind": name,
                "stages": 2,
                "max_batched_tokens": 32,
                "chunked_prefill": chunked,
            },
        )
        # tdpipe runs its two stages as processes (gloo point to point); the baselines run
        # the same stage code in this process, which starts faster (the API test and
        # test_interleaved_in_processes cover more process pipelines)
        executor = "auto" if name == "tdpipe" else "local"
        with Engine(hf_llama_dir, cfg, costs=COSTS, executor=executor, ignore_eos=True) as eng:
            reqs = [
                eng.add_request(eng.make_request(p, n_new, predicted_len=n_new // 2))
                for p in prompts
            ]
            eng.run()
            key = name + ("+chunked" if chunked else "")
            outs[key] = [r.output for r in reqs]
            summaries[key] = eng.summary()
            assert eng.kv_bytes <= budget
            assert eng.bm.peak_used <= eng.bm.num_blocks
    for key, o in outs.items():
        assert o == ref, key
    assert summaries["sequential"]["num_stages"] == 1
    assert summaries["tdpipe"]["num_stages"] == 2
    assert all(s["stages"][-1]["batches"] > 0 for s in summaries.values())
    # the budget was tight: someone had to preempt (tdpipe predicted half the real length)
    assert sum(s["preemptions"] for s in summaries.values()) > 0


@pytest.mark.slow
def test_interleaved_in_processes_matches(hf_llama_dir, hf_greedy):
    prompts = [[256, 1, 2, 3], [256] + list(range(30, 70))]
    ref = hf_greedy(hf_llama_dir, prompts, 16)
    cfg = ServeConfig(
        engine={"kv_budget_bytes": 2**20, "block_size": 4},
        scheduler={"kind": "interleaved", "stages": 2},
    )
    with Engine(hf_llama_dir, cfg, ignore_eos=True) as eng:
        assert eng.num_stages == 2 and type(eng.executor).__name__ == "ProcessExecutor"
        reqs = [eng.add_request(eng.make_request(p, 16)) for p in prompts]
        eng.run()
    assert [r.output for r in reqs] == ref


def test_prompt_logprobs_over_chunks_equal_transformers(hf_llama_dir):
    """Prompt logprobs (``echo``) assembled from chunked prefills over two stages, under a
    KV budget that preempts: per prompt token, transformers' log_softmax (float32) at the
    position before it, the first token ``None``, each computed once."""
    import random

    import torch
    import transformers

    from convergent.serve.sampling import SamplingParams

    rng = random.Random(1)
    prompts = [[256] + [rng.randrange(256) for _ in range(rng.randint(5, 45))] for _ in range(6)]
    m = transformers.LlamaForCausalLM.from_pretrained(hf_llama_dir).eval()
    cfg = ServeConfig(
        engine={"kv_budget_bytes": 96 * 1024, "block_size": 4},
        scheduler={
            "kind": "interleaved",
            "stages": 2,
            "max_batched_tokens": 8,
            "chunked_prefill": True,
            "profile_costs": False,
        },
    )
    sp = SamplingParams(logprobs=0, prompt_logprobs=2)
    with Engine(hf_llama_dir, cfg, executor="local", ignore_eos=True) as eng:
        reqs = [eng.add_request(eng.make_request(p, 12, sampling=sp)) for p in prompts]
        eng.run()
        assert eng.sched.num_preemptions > 0
    for p, r in zip(prompts, reqs, strict=True):
        with torch.no_grad():
            ref = torch.log_softmax(m(torch.tensor([p])).logits[0].float(), -1)
        assert len(r.prompt_logprobs) == len(p) and r.prompt_logprobs[0] is None
        for i in range(1, len(p)):
            e = r.prompt_logprobs[i]
            assert abs(e.logprob - float(ref[i - 1, p[i]])) < 1e-4
            assert list(e.top) == torch.topk(ref[i - 1], 2).indices.tolist()


def test_tdpipe_engine_prefills_a_second_wave_within_the_wait_bound(hf_llama_dir):
    """A fresh engine (TD-Pipe, two stages) on a cost table where switching never pays:
    wave 1 decodes long outputs, wave 2 arrives while it does, and every wave-2 request
    gets its first token within ``tdpipe_max_wait_s`` plus a round, on a clock of engine
    steps (``dt`` per micro-batch submitted), not the wall clock."""
    flat = CostTable([0.0, 1e-3, 0.0, 0.0], [0.0, 0.0], 0.0, 0.0, [2, 2], "flat")
    dt, p = 0.01, 2
    cfg = ServeConfig(
        engine={"block_size": 4},
        scheduler={"kind": "tdpipe", "stages": p, "tdpipe_max_wait_s": 0.5},
    )
    with Engine(hf_llama_dir, cfg, costs=flat, executor="local", ignore_eos=True) as eng:
        eng.sched.clock = lambda: eng.stats.batches * dt
        wave1 = [eng.add_request(eng.make_request([256, i, 7], 150)) for i in range(6)]
        wave2, arrived, first = [], {}, {}

        def on_token(ev):
            if eng.stats.batches >= 20 and not wave2:
                for i in range(3):
                    r = eng.add_request(eng.make_request([256, 50 + i], 4))
                    wave2.append(r)
                    arrived[r.rid] = eng.stats.batches
            if ev.rid in arrived and ev.token >= 0 and ev.rid not in first:
                first[ev.rid] = eng.stats.batches - arrived[ev.rid]

        eng.add_token_listener(on_token)
        eng.run()
    assert all(len(r.output) == 150 for r in wave1) and len(first) == 3
    assert max(first.values()) <= round(0.5 / dt) + 3 * p
    assert eng.sched.aged_switches >= 1
    # wave 1 was still decoding when wave 2 started
    assert max(first.values()) < 150 * 6 // p // 2
