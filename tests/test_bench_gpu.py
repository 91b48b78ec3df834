"""bench/gpu.py on a machine without CUDA: one line saying so, exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "gpu.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_gpu_bench_needs_cuda_and_exits_2(tmp_path):
    out = tmp_path / "gpu.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, str(BENCH), "--out", str(out)], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "bench/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False)"
    ]
    assert not out.exists()
