"""The Triton paged decode kernel on CPU tensors under Triton's interpreter.

``TRITON_INTERPRET=1`` must be in the environment before triton is first imported (the
interpreter swaps ``triton.language``'s own jitted helpers at import), so these tests run
only where it is set: ``tests/serve/test_serve_paged_decode.py`` runs this file in a
subprocess with it (the suite's workers stay uninterpreted). By hand:
``TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/serve/test_serve_paged_triton.py``.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from convergent.models.paged_decode import decode_reference  # noqa: E402
from tests.serve.paged_cases import make_case, run_case, tolerance  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs TRITON_INTERPRET=1 from the start (run in a subprocess by "
           "test_serve_paged_decode.py::test_triton_kernel_under_the_interpreter)")


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_and_reference_equal_the_gather_path(dtype):
    """Decodes (and a prefill and a chunk, which keep the SDPA path) of one mixed step."""
    c = make_case(0, dtype)
    ref_out, _, _, _ = run_case(c, "sdpa_gather")
    tri_out, b, kc, vc = run_case(c, "triton")
    assert b.decode is not None and b.decode.rows.numel() == c["n_dec"]
    tol = tolerance(dtype, c)
    torch.testing.assert_close(tri_out.float(), ref_out.float(), atol=tol, rtol=0)
    plain = decode_reference(c["q"], kc, vc, b.decode, c["bs"], c["scale"])
    rows = b.decode.rows
    torch.testing.assert_close(tri_out[rows].float(), plain.float(), atol=tol, rtol=0)
    other = torch.ones(tri_out.shape[0], dtype=torch.bool)
    other[rows] = False
    assert torch.equal(tri_out[other], ref_out[other])  # prefills: the same path


@pytest.mark.numerics
@pytest.mark.parametrize("kw", [dict(bs=16, nq=8, nkv=1, hd=24), dict(bs=5, nq=2, nkv=2, hd=8),
                                dict(bs=16, nq=6, nkv=2, hd=32)], ids=["gqa8-hd24", "bs5-mha", "rep3"])
def test_triton_tiles_block_sizes_and_heads(kw):
    """Tiles crossing blocks (16; 5, not a power of two), GQA 8/1 and 6/2 (rep 3, padded),
    MHA, head_dim 24 (padded to 32)."""
    c = make_case(10, torch.float32, prefill=False, **kw)
    ref_out, _, _, _ = run_case(c, "sdpa_gather")
    tri_out, _, _, _ = run_case(c, "triton")
    torch.testing.assert_close(tri_out, ref_out, atol=1e-5, rtol=0)


def test_engine_with_the_triton_backend_is_token_exact(hf_llama_dir, hf_greedy):
    """fp32 end to end with serve.engine.attention_backend=triton: transformers' tokens."""
    from convergent.serve.config import ServeConfig
    from convergent.serve.engine import Engine

    prompts = [[256, 72, 105, 33], [256] + list(range(60, 90)), [256, 7]]
    ref = hf_greedy(hf_llama_dir, prompts, 12)
    cfg = ServeConfig(
        engine={"kv_budget_bytes": 2**20, "block_size": 4, "attention_backend": "triton"},
        scheduler={"kind": "sequential", "profile_costs": False},
    )
    with Engine(hf_llama_dir, cfg, ignore_eos=True) as eng:
        (runner,) = eng.executor.runners
        assert runner.backend == "triton"
        reqs = [eng.add_request(eng.make_request(p, 12)) for p in prompts]
        eng.run()
    assert [r.output for r in reqs] == ref


@pytest.mark.numerics
def test_padded_static_decode_with_the_triton_kernel(hf_llama_dir):
    """The decode graphs' static path with the Triton kernel over the static block table
    (3 sequences padded to the bucket of 4; the padding row reads the scratch block only):
    the eager Triton step's logits and tokens (fp32)."""
    from tests.serve.graph_cases import (
        decode_meta,
        eager_logits,
        make_runner,
        prefill,
        static_logits,
    )

    runner = make_runner(hf_llama_dir, backend="triton")
    assert runner.graphs is not None and runner.graphs.backend == "triton"
    toks, lens = prefill(runner, [[256, 72, 105, 33], [256] + list(range(60, 90)), [256, 7]])
    meta = decode_meta(toks, lens)
    ref = eager_logits(runner, meta)
    got = static_logits(runner, meta)
    assert runner.graphs.bucket(3) == 4 and runner.graphs.static_runs == 1
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()


@pytest.mark.numerics
@pytest.mark.parametrize(("dtype", "splits"), [(torch.float32, 7), (torch.bfloat16, 3)])
def test_split_contexts_equal_one_split(dtype, splits):
    """Flash-decoding: each context cut into ``splits`` parts of whole tiles (contexts of
    2..70 tokens, tiles of 16: parts that are empty, partial and whole), the partial
    softmaxes combined, equal the one-split kernel and the reference within the dtype's
    tolerance."""
    from convergent.models.paged_triton import decode_triton

    c = make_case(3, dtype, prefill=False, n_dec=12)
    _, b, kc, vc = run_case(c, "triton")
    d = b.decode
    outs = {}
    for s in (1, splits):
        out = torch.zeros_like(c["q"])
        decode_triton(c["q"], kc, vc, out, d.rows, d.tables, d.ctx, c["bs"], c["scale"],
                      tile=16, splits=s)
        outs[s] = out
    tol = tolerance(dtype, c)
    torch.testing.assert_close(outs[splits].float(), outs[1].float(), atol=tol, rtol=0)
    plain = decode_reference(c["q"], kc, vc, d, c["bs"], c["scale"])
    torch.testing.assert_close(outs[splits][d.rows].float(), plain.float(), atol=tol, rtol=0)


def test_choose_splits():
    from convergent.models.paged_triton import choose_splits

    assert choose_splits(256, 4, 1536, 32) == 2  # 1,024 programs -> 2,048
    assert choose_splits(64, 4, 3072, 32) == 8
    assert choose_splits(4, 1, 8192, 32) == 16  # at most 16
    assert choose_splits(64, 4, 96, 32) == 1  # contexts of under 4 tiles stay whole
    assert choose_splits(1024, 4, 4096, 32) == 1
