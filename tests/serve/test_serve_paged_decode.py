"""Paged decode attention without the gathered copy: the plain-torch block-by-block
reference and FlexAttention (eager on the CPU) against today's gather + SDPA path in
float32 and bfloat16 / float16 (a tolerance from the dtype's eps); the Triton kernel under
Triton's interpreter (test_serve_paged_triton.py, in a subprocess); the backend choice;
and the Triton kernel against the gather path on CUDA (marked ``gpu``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from convergent.models.llama import PagedBatch  # noqa: E402
from convergent.models.paged_decode import decode_reference, resolve_backend  # noqa: E402
from convergent.models.paged_meta import StepBuffers  # noqa: E402
from tests.serve.paged_cases import make_case, run_case, tolerance  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_reads_blocks_in_place_and_equals_the_gather_path(dtype):
    c = make_case(0, dtype)
    ref_out, _, kc, vc = run_case(c, "sdpa_gather")  # the caches with the step's K/V written
    b = PagedBatch.build(StepBuffers("cpu"), c["pos"], c["slots"], c["ql"], c["cl"],
                         c["tables"], c["bs"], backend="triton")  # planned, not run
    plain = decode_reference(c["q"], kc, vc, b.decode, c["bs"], c["scale"])
    assert plain.dtype == dtype and plain.shape == (c["n_dec"], *c["q"].shape[1:])
    torch.testing.assert_close(plain.float(), ref_out[b.decode.rows].float(),
                               atol=tolerance(dtype, c), rtol=0)


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_with_the_block_mask_of_the_tables(dtype):
    """FlexAttention (eager on the CPU: it materialises the scores; a check of the mask),
    the block mask built from the block tables: each query tile visits its pages only."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    c = make_case(3, dtype)
    ref_out, _, _, _ = run_case(c, "sdpa_gather")
    flex_out, b, _, _ = run_case(c, "flex")
    mask = b.decode.cache["flex_mask"]
    pages = sum(-(-x // c["bs"]) for x in c["cl"][: c["n_dec"]])
    assert int(mask.kv_num_blocks.sum()) == pages
    torch.testing.assert_close(flex_out.float(), ref_out.float(), atol=tolerance(dtype, c), rtol=0)


@pytest.mark.numerics
def test_flex_over_two_query_tiles():
    """More decodes than one query tile (128) holds: each tile visits its own pages."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    c = make_case(4, torch.float32, n_dec=140, nq=2, nkv=1, hd=8)
    ref_out, _, _, _ = run_case(c, "sdpa_gather")
    flex_out, b, _, _ = run_case(c, "flex")
    counts = b.decode.cache["flex_mask"].kv_num_blocks.flatten().tolist()
    assert len(counts) == 2 and sum(counts) == sum(-(-x // c["bs"]) for x in c["cl"][:140])
    torch.testing.assert_close(flex_out, ref_out, atol=1e-5, rtol=0)


def test_backend_choice_and_refusals(monkeypatch):
    assert resolve_backend("auto", "cpu") == "sdpa_gather"
    assert resolve_backend("flex", "cpu") == "flex"
    assert resolve_backend("sdpa_gather", "cuda") == "sdpa_gather"
    with pytest.raises(ValueError, match="attention backend"):
        resolve_backend("paged", "cpu")
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        run_case(make_case(0, torch.float32), "triton")


def test_triton_kernel_under_the_interpreter():
    """test_serve_paged_triton.py in a fresh process with TRITON_INTERPRET=1 (set before
    triton is imported, as the interpreter needs): the kernel against the gather path and
    the reference in fp32 / bf16 / fp16, over block sizes and GQA shapes, and the engine's
    tokens with the triton backend against transformers."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         str(ROOT / "tests/serve/test_serve_paged_triton.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert " passed" in out and "skipped" not in out.splitlines()[-1], out[-2000:]


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")


@pytest.mark.gpu
@_CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kw", [dict(), dict(bs=16, nq=32, nkv=4, hd=64, n_dec=40)],
                         ids=["tiny", "llama1b"])
def test_triton_equals_gather_on_cuda(dtype, kw):
    """On the GPU (compiled Triton): the kernel equals the gather path in fp32 (IEEE
    float32 on both sides: the kernel never uses TF32) and in bf16 (the dtype's
    tolerance), at the test model's shape and the 1.1B bench model's (32/4 heads,
    head_dim 64, blocks of 16)."""
    pytest.importorskip("triton")
    c = make_case(7, dtype, device="cuda", **kw)
    ref_out, _, _, _ = run_case(c, "sdpa_gather")
    tri_out, b, kc, vc = run_case(c, "triton")
    tol = tolerance(dtype, c)
    torch.testing.assert_close(tri_out.float(), ref_out.float(), atol=tol, rtol=0)
    plain = decode_reference(c["q"], kc, vc, b.decode, c["bs"], c["scale"])
    torch.testing.assert_close(tri_out[b.decode.rows].float(), plain.float(), atol=tol, rtol=0)


@pytest.mark.gpu
@_CUDA
def test_engine_auto_backend_on_cuda_is_triton_and_token_exact(hf_llama_dir, hf_greedy):
    """serve.engine.attention_backend=auto on CUDA takes the Triton kernel; fp32 tokens
    equal transformers' (on the CPU: fp32 greedy is device-independent on this model)."""
    pytest.importorskip("triton")
    from convergent.serve.config import ServeConfig
    from convergent.serve.engine import Engine

    prompts = [[256, 72, 105, 33], [256] + list(range(60, 90)), [256, 7]]
    ref = hf_greedy(hf_llama_dir, prompts, 16)
    cfg = ServeConfig(engine={"kv_budget_bytes": 2**20, "block_size": 4, "device": "cuda"},
                      scheduler={"kind": "sequential", "profile_costs": False})
    with Engine(hf_llama_dir, cfg, ignore_eos=True) as eng:
        (runner,) = eng.executor.runners
        assert runner.backend == "triton"
        reqs = [eng.add_request(eng.make_request(p, 16)) for p in prompts]
        eng.run()
    assert [r.output for r in reqs] == ref
