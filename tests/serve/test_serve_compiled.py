"""The compiled CPU decode step (serve.engine.compile=decode) against the eager forward."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from convergent.models.llama import LlamaConfig, LlamaForCausalLM, PagedBatch  # noqa: E402
from convergent.models.paged_compiled import CompiledDecode  # noqa: E402
from convergent.models.paged_linear import fuse_for_serving  # noqa: E402
from convergent.serve.kv_cache import KVCache  # noqa: E402

EPS = torch.finfo(torch.float32).eps


def _decode_batch(rng, tables, lens, bs):
    """A pure decode step: one new token at the end of each sequence's context."""
    ids, pos, slots = [], [], []
    for i, c in enumerate(lens):
        while len(tables[i]) * bs < c:
            tables[i].append(tables["next"])
            tables["next"] += 1
        ids.append(rng.randrange(256))
        pos.append(c - 1)
        slots.append(tables[i][(c - 1) // bs] * bs + (c - 1) % bs)
    batch = PagedBatch(torch.tensor(pos), torch.tensor(slots), [1] * len(lens), list(lens),
                       [tables[i] for i in range(len(lens))], bs)
    batch.plan()
    return torch.tensor(ids), batch


def _model(cfg, seed):
    model = LlamaForCausalLM(cfg).eval()
    model.reset_parameters(std=0.2, seed=seed)
    fuse_for_serving(model, release=True, keep_plain=True)  # as a stage with compile=decode
    return model


@pytest.mark.numerics
def test_compiled_decode_matches_the_eager_step():
    """Logits and KV writes of compiled steps (1, 5 and 12 sequences) against the eager
    step's; a second model compiled in the same process after the first (its own graph:
    the guards are skipped after warm-up, and the weights are each graph's constants) does
    not change the first's results, and answers with its own weights."""
    cfg = LlamaConfig.tiny(max_position_embeddings=256)
    models = [_model(cfg, 0), _model(cfg, 1)]
    bs, blocks = 4, 200
    kvs = [KVCache(cfg.num_hidden_layers, blocks + 1, bs, cfg.num_key_value_heads, cfg.head_dim)
           for _ in models]
    with torch.inference_mode():
        for kv in kvs:  # a filled cache: every earlier key and value is random
            for k, v in kv.layers:
                k.normal_()
                v.normal_()
        refs = [[(k.clone(), v.clone()) for k, v in kv.layers] for kv in kvs]
        comps = [CompiledDecode(m, kv.layers, first=True, last=True, block_size=bs,
                                scratch_block=blocks) for m, kv in zip(models, kvs, strict=True)]
        for comp in comps:
            comp.warm_up(torch.float32)
            assert comp.steps == 0
        rng = random.Random(0)
        tables = {i: [] for i in range(12)}
        tables["next"] = 0
        for lens in ([7], [3, 9, 30, 17, 5], [rng.randint(2, 60) for _ in range(12)]):
            ids, batch = _decode_batch(rng, tables, lens, bs)
            assert CompiledDecode.fits(batch)
            for model, comp, kv, ref in zip(models, comps, kvs, refs, strict=True):
                got = comp.run(ids, batch)
                want = model.logits(model.model.forward_paged(ids, batch, ref))
                # float32 rounding of a few layers of sums (fused loops add in another order)
                scale = want.abs().max().item()
                torch.testing.assert_close(got, want, rtol=0, atol=64 * EPS * scale)
                for (k, v), (rk, rv) in zip(kv.layers, ref, strict=True):
                    slots = batch.slot_mapping
                    torch.testing.assert_close(k[slots], rk[slots], rtol=0, atol=64 * EPS * 8)
                    torch.testing.assert_close(v[slots], rv[slots], rtol=0, atol=64 * EPS * 8)
        assert [c.steps for c in comps] == [3, 3]


def test_a_step_with_prefills_is_not_compiled():
    bs = 4
    batch = PagedBatch(torch.tensor([0, 1, 5]), torch.tensor([0, 1, 9]), [2, 1], [2, 6],
                       [[0], [1, 2]], bs)
    batch.plan()
    assert not CompiledDecode.fits(batch)


def test_compile_is_the_cpu_float32_path():
    from pydantic import ValidationError

    from convergent.serve.config import EngineConfig

    assert EngineConfig(compile="decode").compile == "decode"
    for bad in ({"device": "cuda"}, {"dtype": "bfloat16"}, {"quantize": "int8"}):
        with pytest.raises(ValidationError, match="compile=decode"):
            EngineConfig(compile="decode", **bad)


def test_engine_with_compiled_decode_gives_transformers_greedy_tokens(hf_llama_dir, hf_greedy):
    """fp32 end to end through the engine: the decode steps run compiled (counted in the
    summary) and the greedy tokens stay transformers'."""
    from convergent.serve.config import ServeConfig
    from convergent.serve.engine import Engine

    prompts = [[256, 72, 105, 33], [256] + list(range(60, 90)), [256, 7], [256, 9, 9]]
    cfg = ServeConfig(engine={"kv_budget_bytes": 2**20, "block_size": 4, "max_model_len": 128,
                              "compile": "decode"},
                      scheduler={"kind": "sequential", "profile_costs": False, "max_num_seqs": 8})
    with Engine(hf_llama_dir, cfg, ignore_eos=True) as eng:
        reqs = [eng.add_request(eng.make_request(p, 12)) for p in prompts]
        eng.run()
        steps = eng.executor.runners[0].compiled.steps
        assert steps > 0 and eng.summary()["compiled_decode_steps"] == steps
    assert [r.output for r in reqs] == hf_greedy(hf_llama_dir, prompts, 12)
