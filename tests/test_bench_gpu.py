"""bench/gpu/throughput.py on a machine without CUDA: one line saying so, exit code 2."""

from __future__ import annotations

import subprocess

import pytest
import torch

from bench.lib.paths import child_env, module_argv


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_gpu_bench_needs_cuda_and_exits_2(tmp_path):
    out = tmp_path / "gpu.json"
    env = child_env(CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([*module_argv("bench.gpu.throughput"), "--out", str(out)], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "bench/gpu/throughput.py needs a CUDA GPU (torch.cuda.is_available() is False)"
    ]
    assert not out.exists()
