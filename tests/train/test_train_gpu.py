"""Training on CUDA GPUs (marked ``gpu``; skipped with the reason where CUDA is absent)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.train.trainhelpers import LM_BASE, run_training

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)"),
]

ON_GPU = [o for o in LM_BASE if not o.startswith("train.device=")] + ["train.device=cuda"]


def _final_loss(tmp_path, overrides, nproc, name):
    result, steps, run = run_training(tmp_path, overrides, nproc, name)
    placed = run.read_metrics("placement")
    return result.final_loss, steps, placed[0]


@pytest.mark.parametrize("dtype,rel", [("fp32", 2e-2), ("bf16", 5e-2)])
def test_single_gpu_training_close_to_cpu_fp32(tmp_path, dtype, rel):
    """One GPU (TF32 on for fp32; bf16 autocast) ends near the CPU fp32 loss."""
    cpu, _, _ = _final_loss(tmp_path, [*LM_BASE, "parallel.strategy=single"], 1, "cpu")
    gpu, steps, placed = _final_loss(
        tmp_path, [*ON_GPU, "parallel.strategy=single", f"precision.dtype={dtype}"], 1, dtype
    )
    assert placed["device"] == "cuda" and placed["gpu_names"] and placed["dtype"] == dtype
    assert all(r.data_wait_s >= 0 and r.step_s > 0 for r in steps)
    assert math.isclose(gpu, cpu, rel_tol=rel), (gpu, cpu)


def test_ddp_on_every_visible_gpu(tmp_path):
    """``parallel.nproc: auto`` starts one rank per visible GPU, NCCL between them."""
    n = torch.cuda.device_count()
    _, steps, placed = _final_loss(tmp_path, [*ON_GPU, "parallel.strategy=ddp"], None, "ddp")
    assert placed["world"] == n and placed["backend"] == "nccl"
    assert [r.step for r in steps] == [1, 2, 3, 4, 5]
    assert all(r.world == n for r in steps)


def test_cuda_event_timer_measures_device_time_without_syncing():
    from convergent.monitor.timers import StepTimer

    dev = torch.device("cuda", 0)
    t = StepTimer(dev)
    t.reset()
    a = torch.randn(2048, 2048, device=dev)
    with t.section("compute"):
        for _ in range(20):
            a = a @ a / 2048
    snap = t.snapshot()  # nothing waited for yet
    times = snap.resolve()
    assert times["compute"] > 0 and times["step_s"] >= times["compute"] * 0.99


def test_prefetch_copies_pinned_batches_to_the_gpu_on_a_side_stream():
    from convergent.train.prefetch import Prefetcher

    dev = torch.device("cuda", 0)

    def make(step):
        g = torch.Generator().manual_seed(step)
        return [(torch.randn(1000, 3, generator=g), torch.arange(step, step + 5))]

    feed = Prefetcher(make, range(4), dev, depth=2)
    try:
        for step in range(4):
            (x, i), = feed.get(step)
            feed.ahead()
            assert x.device.type == "cuda" and i.device.type == "cuda"
            want_x, want_i = make(step)[0]
            assert torch.equal(x.cpu(), want_x) and torch.equal(i.cpu(), want_i)
    finally:
        feed.close()


def test_lm_attention_runs_a_fused_sdpa_kernel_in_bf16():
    """Training attention goes through a fused SDPA kernel (flash, cuDNN or memory-efficient),
    never the math fallback that materialises the score matrix."""
    from torch.profiler import ProfilerActivity, profile

    from convergent.models.llama import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).cuda()
    ids = torch.randint(0, 512, (2, 256), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16), profile(activities=[ProfilerActivity.CPU]) as prof:
        model(ids).float().sum().backward()
    ops = {e.key for e in prof.key_averages()}
    fused = [o for o in ops if any(k in o for k in ("flash", "cudnn_attention", "efficient_attention"))]
    assert fused, sorted(o for o in ops if "attention" in o)
    assert not [o for o in ops if "_scaled_dot_product_attention_math" in o]
