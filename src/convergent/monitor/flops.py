"""FLOP counting and MFU (model FLOPs utilisation).

MFU = achieved model FLOP/s / peak FLOP/s of the device for the dtype in use.

* Achieved FLOPs are counted, not guessed: :func:`count_flops` runs one real training
  micro-step under ``torch.utils.flop_counter.FlopCounterMode`` (matmuls, convolutions,
  attention — forward, backward and, for force training, the double backward), and the
  trainer scales that count by the step's atoms or tokens.
* Peak on CPU is *measured*: the best of several timed square GEMMs in the dtype, with
  the process's torch thread count (:func:`measured_cpu_peak`), cached per machine,
  thread count, dtype and torch version. On CUDA the peak comes from
  :data:`GPU_PEAK_FLOPS` (dense, no sparsity) matched on the device name.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from convergent.resources import cpu_name

# Dense peak FLOP/s per GPU (vendor datasheets, no structured sparsity).
GPU_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12},
    "H100 PCIe": {"fp32": 51e12, "tf32": 378e12, "bf16": 756e12, "fp16": 756e12},
    "H100": {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12},
    "H200": {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12},
    "A100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    "A10G": {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12},
    "L40S": {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362e12, "fp16": 362e12},
    "L4": {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12},
    "V100": {"fp32": 15.7e12, "fp16": 125e12, "bf16": 15.7e12},
    "MI250X": {"fp32": 47.9e12, "bf16": 383e12, "fp16": 383e12},
    "MI300X": {"fp32": 163.4e12, "bf16": 1307e12, "fp16": 1307e12},
    "GH200": {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12},
}


def gpu_peak_flops(device_name: str, dtype: str) -> float | None:
    """Table peak for a GPU name (longest matching key wins), or None if unknown."""
    best: tuple[int, float] | None = None
    for key, peaks in GPU_PEAK_FLOPS.items():
        if key.lower() in device_name.lower() and dtype in peaks:
            if best is None or len(key) > best[0]:
                best = (len(key), peaks[dtype])
    return best[1] if best else None


def _torch_dtype(dtype: str) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def _cache_file() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "convergent"
    return root / "gemm_peak.json"


def measure_gemm_flops(dtype: str = "fp32", n: int = 512, repeats: int = 5) -> float:
    """Best achieved FLOP/s of an ``n x n @ n x n`` GEMM in ``dtype`` with current threads."""
    import torch

    td = _torch_dtype(dtype)
    a = torch.randn(n, n).to(td)
    b = torch.randn(n, n).to(td)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    inner = 4
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - t0) / inner)
    return 2.0 * n**3 / best


def measured_cpu_peak(dtype: str = "fp32", use_cache: bool = True) -> float:
    """Measured CPU GEMM peak (FLOP/s) for ``dtype`` at this process's torch thread count.

    Cached in ``~/.cache/convergent/gemm_peak.json`` keyed by CPU model, threads, dtype
    and torch version (a shared machine makes single measurements noisy; the cache keeps
    MFU comparable between runs). The max of the cached and a new value is never taken:
    the first measurement stands until the cache file is deleted.
    """
    import torch

    key = f"{cpu_name()}|threads={torch.get_num_threads()}|{dtype}|torch={torch.__version__}"
    path = _cache_file()
    cache: dict[str, float] = {}
    if use_cache and path.exists():
        try:
            cache = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            cache = {}
        if key in cache:
            return float(cache[key])
    value = measure_gemm_flops(dtype)
    if use_cache:
        cache[key] = value
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass
    return value


def device_peak_flops(device: Any, dtype: str, override: float | None = None) -> float | None:
    """Peak FLOP/s of one process's device for ``dtype``: override, GPU table or CPU GEMM."""
    if override:
        return float(override)
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        name = torch.cuda.get_device_name(device)
        return gpu_peak_flops(name, "tf32" if dtype == "fp32" else dtype)
    return measured_cpu_peak(dtype)


def count_flops(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn()`` under FlopCounterMode; return (its result, total FLOPs counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        out = fn()
    return out, int(counter.get_total_flops())


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1] (None when the peak or time is unknown)."""
    if not peak or seconds <= 0:
        return None
    return float(flops) / seconds / peak
