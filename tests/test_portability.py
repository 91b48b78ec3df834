"""`make test-portability` runs the tests marked ``numerics`` with ATen's and oneDNN's CPU
kernels restricted by environment variables. A misspelt variable would be ignored
silently and every run would use the machine's best kernels, so check here that the
names really take effect in a fresh interpreter (torch reads them at start-up)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

PROBE = ("import torch; print(torch.backends.cpu.get_cpu_capability(), "
         "torch.ops.mkldnn._is_mkldnn_bf16_supported())")


def _probe(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env},
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split()


def test_aten_cpu_capability_default_is_honoured():
    assert _probe(ATEN_CPU_CAPABILITY="default")[0] == "DEFAULT"


def test_onednn_max_cpu_isa_avx2_turns_off_its_bf16_kernels():
    """oneDNN's bf16 kernels need AVX-512; capped at AVX2 torch no longer offers them
    (where the machine has them at all: otherwise both runs report False)."""
    best = _probe()[1]
    assert _probe(ONEDNN_MAX_CPU_ISA="AVX2")[1] == "False"
    if best == "True":
        assert _probe(ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16")[1] == "True"
