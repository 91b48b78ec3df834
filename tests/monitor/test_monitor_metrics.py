"""Timers, FLOP counting / MFU and the metric sinks (JSONL, TensorBoard, Prometheus)."""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest
import torch

from convergent.monitor.flops import count_flops, gpu_peak_flops, measure_gemm_flops, mfu
from convergent.monitor.sinks import MetricSinks
from convergent.monitor.timers import StepTimer, peak_memory_bytes
from convergent.runsdb.trainrecords import TrainStep, read_train_records


def test_step_timer_accumulates_sections():
    t = StepTimer()
    with t.section("compute"):
        sum(range(10000))
    with t.section("compute"):
        sum(range(10000))
    t.add("comm", 0.25)
    t.add("comm", -1.0)  # negative durations are clamped
    assert t.get("compute") > 0
    assert t.get("comm") == 0.25
    assert t.get("missing") == 0.0
    assert t.elapsed() >= t.get("compute")
    t.reset()
    assert t.get("compute") == 0.0


def test_peak_memory_is_positive():
    assert peak_memory_bytes() > 1_000_000


def test_count_flops_counts_matmul_forward_and_backward():
    a = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(16, 4)

    def step():
        (a @ b).sum().backward()

    _, flops = count_flops(step)
    # forward 2*8*16*4, backward grad_a = grad_out @ b^T: another 2*8*4*16
    assert flops == 2 * (2 * 8 * 16 * 4)


def test_measured_gemm_and_mfu():
    peak = measure_gemm_flops("fp32", n=128, repeats=2)
    assert peak > 1e6
    assert mfu(peak, 1.0, peak) == pytest.approx(1.0)
    assert mfu(1.0, 0.0, peak) is None
    assert mfu(1.0, 1.0, None) is None


def test_gpu_table_matches_longest_name():
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3 SXM", "bf16") == pytest.approx(989.4e12)
    assert gpu_peak_flops("NVIDIA A100-SXM4-40GB", "bf16") == pytest.approx(312e12)
    assert gpu_peak_flops("Some Unknown GPU", "bf16") is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sinks_write_jsonl_tensorboard_and_prometheus(tmp_path):
    port = _free_port()
    sinks = MetricSinks(tmp_path / "m.jsonl", tmp_path / "tb", port)
    try:
        sinks.write(TrainStep(step=3, loss=1.5, strategy="ddp").to_dict())
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        text = body.decode()
        assert "convergent_train_step_loss 1.5" in text
        assert "convergent_train_step_step 3.0" in text
    finally:
        sinks.close()
    (step,), _ = read_train_records(tmp_path / "m.jsonl")
    assert (step.loss, step.step, step.strategy) == (1.5, 3, "ddp") and step.time is not None
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_cpu_peak_cache_keeps_the_best_measurement(tmp_path, monkeypatch):
    from convergent.monitor.flops import cpu_peak_key, measured_cpu_peak

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = tmp_path / "convergent" / "gemm_peak.json"
    key = cpu_peak_key("fp32", torch.get_num_threads())
    assert "threads=" in key and key.endswith("|fp32")
    # a low first value (as if measured under load) is replaced by a real measurement
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({key: {"flops": 1.0, "measurements": 1}}))
    first = measured_cpu_peak("fp32")
    entry = json.loads(cache.read_text())[key]
    assert first.flops > 1e6 and entry["flops"] == first.flops
    assert entry["measurements"] == 2 and first.source == f"measured:{key}"
    # a higher cached value is a better estimate of the peak: it stands
    cache.write_text(json.dumps({key: {"flops": 1e30, "measurements": 5}}))
    second = measured_cpu_peak("fp32")
    entry = json.loads(cache.read_text())[key]
    assert second.flops == 1e30 and entry["flops"] == 1e30
    assert entry["measurements"] == 6 and 1e6 < entry["last"] < 1e30
    # other dtypes / thread counts are separate entries
    assert cpu_peak_key("bf16", 1) != cpu_peak_key("fp32", 1) != cpu_peak_key("fp32", 2)


def test_gpu_peak_source_and_tf32_choice():
    from convergent.monitor.flops import device_peak, gpu_peak

    assert gpu_peak("NVIDIA A100-SXM4-80GB", "fp32").flops == pytest.approx(19.5e12)
    tf = gpu_peak("NVIDIA A100-SXM4-80GB", "fp32", tf32=True)
    assert tf.flops == pytest.approx(156e12) and tf.source.endswith(":tf32")
    assert gpu_peak("Tesla V100-SXM2", "fp32", tf32=True).source.endswith(":fp32")
    assert gpu_peak("Unknown", "bf16").record() == {"peak_flops": None, "peak_source": "unknown"}
    assert device_peak(torch.device("cpu"), "fp32", override=5e9).record() == {
        "peak_flops": 5e9, "peak_source": "override"}
