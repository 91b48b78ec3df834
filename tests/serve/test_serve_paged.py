"""Batched paged attention (padded decode groups, padded fresh prefills, chunked
prefills) against the dense causal forward, and the in-situ cost profile through real
stage processes."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from convergent.models.llama import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    PagedBatch,
    pad_groups,
)
from convergent.serve.kv_cache import KVCache  # noqa: E402


def test_pad_groups_partition_and_bound_padding():
    rng = random.Random(0)
    lengths = [rng.choice([1, 2, 3, 20, 40]) * rng.randint(1, 3) for _ in range(60)]
    groups = pad_groups(lengths, min_size=4, max_waste=0.3)
    assert sorted(i for g in groups for i in g) == list(range(60))
    assert len(groups) > 1  # very different lengths are not padded into one group
    for g in groups:
        width = lengths[g[0]]
        assert width == max(lengths[i] for i in g)
        if len(g) > 4:  # past the minimum size, padding stays within the cap
            assert width * len(g) - sum(lengths[i] for i in g) <= 0.3 * width * len(g) + width


def _paged_step(model, kv, bs, tables, seqs, new, max_waste=None):
    """One packed batch: ``new[i]`` new tokens of each sequence ``seqs[i]`` (token list)."""
    ids, pos, slots, ql, cl = [], [], [], [], []
    for i, (toks, n) in enumerate(zip(seqs, new, strict=True)):
        c = len(toks)
        need = -(-c // bs)
        while len(tables[i]) < need:
            tables[i].append(tables["next"])
            tables["next"] += 1
        for p in range(c - n, c):
            ids.append(toks[p])
            pos.append(p)
            slots.append(tables[i][p // bs] * bs + p % bs)
        ql.append(n)
        cl.append(c)
    batch = PagedBatch(
        torch.tensor(pos), torch.tensor(slots), ql, cl, [tables[i] for i in range(len(seqs))], bs,
        max_waste=max_waste,
    )
    h = model.model.forward_paged(torch.tensor(ids), batch, kv.layers)
    return model.logits(h), batch


@pytest.mark.numerics
@pytest.mark.parametrize("max_waste", [None, 0.3])  # the CPU's one decode group; several
def test_batched_paged_forward_matches_dense(max_waste):
    cfg = LlamaConfig.tiny(max_position_embeddings=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.reset_parameters(std=0.2, seed=0)
    bs = 4
    kv = KVCache(cfg.num_hidden_layers, 400, bs, cfg.num_key_value_heads, cfg.head_dim)
    rng = random.Random(1)
    n = 20
    lens = [rng.choice([1, 2, 5, 9, 30, 70]) for _ in range(n)]
    seqs = [[rng.randrange(256) for _ in range(m)] for m in lens]
    tables = {i: [] for i in range(n)}
    tables["next"] = 0
    with torch.inference_mode():
        # step 1: fresh prompts, except the first three which prefill only a first chunk
        first = [max(1, m // 2) if i < 3 and m > 1 else m for i, m in enumerate(lens)]
        _paged_step(model, kv, bs, tables, [s[:f] for s, f in zip(seqs, first, strict=True)], first)
        # step 2: the rest of the chunked prompts plus one decode token for everyone else
        for s in seqs:
            s.append(rng.randrange(256))
        new = [len(s) - f if i < 3 else 1 for i, (s, f) in enumerate(zip(seqs, first, strict=True))]
        logits, batch = _paged_step(model, kv, bs, tables, seqs, new, max_waste)
        groups = len(batch.decode_groups)
        assert (groups == 1 if max_waste is None else groups >= 2) and batch.chunked
        off = 0
        for s, k in zip(seqs, new, strict=True):
            ref = model(torch.tensor([s]))[0, -k:]
            torch.testing.assert_close(logits[off : off + k], ref, atol=2e-4, rtol=1e-4)
            off += k


def test_in_situ_profile_through_stage_processes(hf_llama_dir):
    from convergent.serve.config import ServeConfig
    from convergent.serve.engine import Engine
    from convergent.serve.insitu import sweep_shapes

    cfg = ServeConfig(
        engine={"kv_budget_bytes": 256 * 1024, "block_size": 4},
        scheduler={"kind": "tdpipe", "stages": 2, "max_batched_tokens": 64, "max_num_seqs": 32},
    )
    with Engine(hf_llama_dir, cfg, ignore_eos=True) as eng:
        costs = eng.costs
        assert costs.source == "profiled in situ"
        assert costs is eng.sched.costs  # the switch rule uses it
        assert len(costs.stage_coef) == 2 and costs.hop >= 0 and costs.dispatch >= 0
        assert all(any(c > 0 for c in sc) for sc in costs.stage_coef)  # fitted, not empty
        assert costs.decode_time(16, 32) > 0 and costs.prefill_time(32) > 0
        # the sweep wrote only unowned KV blocks: a request decodes as in a fresh engine
        r = eng.add_request(eng.make_request([256, 5, 6, 7], 6))
        eng.run()
        first = r.output
    off = cfg.scheduler.model_copy(update={"profile_costs": False})
    with Engine(hf_llama_dir, cfg.model_copy(update={"scheduler": off}), ignore_eos=True) as eng:
        assert eng.costs is None
        r = eng.add_request(eng.make_request([256, 5, 6, 7], 6))
        eng.run()
        assert r.output == first
    cap = 256
    for ql, cl in sweep_shapes(64, 32, 2048, cap):
        assert sum(ql) <= 64 and len(ql) <= 32 and sum(cl) <= cap + 128


@pytest.mark.numerics
def test_fused_serving_projections_match_the_plain_forward():
    """fuse_for_serving (one QKV and one gate-up GEMM per layer, oneDNN-prepacked weights
    on the CPU): the same paged logits as the model's own nn.Linear layers, within float32
    rounding, and the same greedy tokens; INT8 layers are left alone; the dense forward
    and the state dict do not change."""
    import copy

    from convergent.compress.quant import quantize
    from convergent.models.paged_linear import fuse_for_serving

    cfg = LlamaConfig.tiny(max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    model.reset_parameters(std=0.2, seed=3)
    fused = copy.deepcopy(model)
    keys = set(fused.state_dict())
    assert fuse_for_serving(fused) == cfg.num_hidden_layers
    assert set(fused.state_dict()) == keys and fused.serving_head is not None
    rng = random.Random(4)
    seqs = [[rng.randrange(256) for _ in range(rng.choice([1, 3, 9, 30]))] for _ in range(12)]
    out = []
    for m in (model, fused):
        kv = KVCache(cfg.num_hidden_layers, 200, 4, cfg.num_key_value_heads, cfg.head_dim)
        tables = {i: [] for i in range(len(seqs))}
        tables["next"] = 0
        with torch.inference_mode():
            first, _ = _paged_step(m, kv, 4, tables, seqs, [len(s) for s in seqs])
            last = torch.tensor([len(s) for s in seqs]).cumsum(0) - 1  # each prompt's end
            grown = [s + [t] for s, t in zip(seqs, first[last].argmax(-1).tolist(), strict=True)]
            second, _ = _paged_step(m, kv, 4, tables, grown, [1] * len(seqs))
        out.append((first, second))
    for a, b in zip(*out, strict=True):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    ids = torch.tensor([seqs[3]])
    with torch.inference_mode():
        torch.testing.assert_close(fused(ids), model(ids), atol=0, rtol=0)
    q8 = quantize(copy.deepcopy(model), "int8")[0]
    assert fuse_for_serving(q8) == 0 and q8.serving_head is None


@pytest.mark.parametrize("pack", [True, False])
def test_released_serving_weights_are_held_once(pack):
    """fuse_for_serving(release=True), as a CPU stage calls it: the fused modules keep no
    weight of their own (views of the fused plain weight, or nothing beside the packed
    copy), a head tied to the embedding keeps its weight, and the paged logits are those
    of the model fused without release, bit for bit."""
    import copy

    from convergent.models.paged_linear import fuse_for_serving

    cfg = LlamaConfig.tiny(max_position_embeddings=128, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    model.reset_parameters(std=0.2, seed=5)
    kept, released = copy.deepcopy(model), copy.deepcopy(model)
    fuse_for_serving(kept, pack=pack)
    fuse_for_serving(released, pack=pack, release=True)
    packed = released.serving_head.packed is not None
    for layer in released.model.layers.values():
        at = layer.self_attn
        for m in (at.q_proj, at.k_proj, at.v_proj, at.o_proj, layer.mlp.down_proj):
            if packed:
                assert m.weight.numel() == 0
        if not packed:  # the modules read views of the fused weights
            fused = at.serving.qkv.weight
            assert at.k_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert released.lm_head.weight is released.model.embed_tokens.weight
    assert released.lm_head.weight.numel() == cfg.vocab_size * cfg.hidden_size
    rng = random.Random(6)
    seqs = [[rng.randrange(256) for _ in range(rng.choice([2, 7, 20]))] for _ in range(6)]
    out = []
    for m in (kept, released):
        kv = KVCache(cfg.num_hidden_layers, 100, 4, cfg.num_key_value_heads, cfg.head_dim)
        tables = {i: [] for i in range(len(seqs))}
        tables["next"] = 0
        with torch.inference_mode():
            out.append(_paged_step(m, kv, 4, tables, seqs, [len(s) for s in seqs])[0])
    assert torch.equal(out[0], out[1])
