"""Measured device peaks, and the fraction of them a training step achieves (issue 42 item 5).

The GPU benchmark's throughputs say how fast; these say how far from the machine's own
limits. Both peaks are *measured* on the device in the run, not read from a datasheet:

* **matmul peak** — the best FLOP/s of a square GEMM (``n`` = 8,192 on CUDA, timed with CUDA
  events; on CPU :func:`convergent.monitor.flops.measure_gemm_flops`, the same probe MFU
  uses) in bf16 and in fp32 with the trainer's matmul precision (TF32 on CUDA);
* **copy bandwidth** — the best bytes/s of ``dst.copy_(src)`` over a buffer far larger than
  the caches (1 GiB on CUDA, 256 MiB on CPU), counting the read and the write.

A step's work is counted on the side's own model and batch (:func:`step_cost`): FLOPs by
``FlopCounterMode`` over one forward + backward (the force double backward included), and
a bytes model — every tensor the eager autograd graph saves is written in the forward
and read in the backward (2 x its bytes), and the parameters move 10 x their bytes (read
in forward and backward, the gradient written, AdamW reading parameter, gradient and two
moments and writing three). The bytes model is an estimate of the traffic an unfused
eager step must make, not a hardware counter: a compiled step that recomputes instead of
saving moves less, so its fraction may exceed what its real traffic is.

:func:`fractions` turns a side's units/s into ``matmul_fraction`` and
``bandwidth_fraction``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

PARAM_TRAFFIC = 10  # x parameter bytes per step: fwd read, bwd read, grad write, AdamW 4 reads + 3 writes


@dataclass(frozen=True)
class DevicePeaks:
    """Measured peaks of one device: GEMM FLOP/s per dtype and copy bytes/s."""

    device: str
    matmul_flops: dict[str, float]
    copy_bytes_per_s: float
    gemm_n: int
    copy_bytes: int

    def record(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StepCost:
    """The work of one training step on one batch: FLOPs and the bytes model."""

    units: int  # atoms or tokens in the batch
    flops: int
    saved_bytes: int  # distinct storages the autograd graph saved (parameters excluded)
    param_bytes: int

    @property
    def bytes_model(self) -> int:
        return 2 * self.saved_bytes + PARAM_TRAFFIC * self.param_bytes

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "bytes_model": self.bytes_model}


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(device: Any, fn: Any, repeats: int, inner: int) -> float:
    """Best time of ``inner`` calls of ``fn`` over ``repeats`` (CUDA events on CUDA)."""
    import torch

    fn()  # warm-up
    _sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(inner):
                fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t0) / inner)
    return min(times)


def matmul_peak(device: Any, dtype: str, n: int, repeats: int = 5) -> float:
    """Best FLOP/s of an ``n x n`` GEMM in ``dtype`` (``tf32`` = fp32 at "high" precision)."""
    import torch

    td = torch.bfloat16 if dtype == "bf16" else torch.float32
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if dtype == "tf32" else "highest")
    try:
        a = torch.randn(n, n, device=device).to(td)
        b = torch.randn(n, n, device=device).to(td)
        s = _best_seconds(device, lambda: torch.mm(a, b), repeats, inner=4)
    finally:
        torch.set_float32_matmul_precision(prev)
    return 2.0 * n**3 / s


def copy_bandwidth(device: Any, nbytes: int, repeats: int = 5) -> float:
    """Best bytes/s of a device-to-device copy of ``nbytes`` (read + write counted)."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    s = _best_seconds(device, lambda: dst.copy_(src), repeats, inner=3)
    return 2.0 * src.numel() * 4 / s


def measure_peaks(device: Any, gemm_n: int | None = None, copy_bytes: int | None = None
                  ) -> DevicePeaks:
    """The device's matmul peaks (bf16, fp32 or tf32) and copy bandwidth, measured now."""
    import torch

    device = torch.device(device)
    cuda = device.type == "cuda"
    n = gemm_n or (8192 if cuda else 512)
    nbytes = copy_bytes or (2**30 if cuda else 2**28)
    dtypes = ["bf16", "tf32"] if cuda else ["bf16", "fp32"]
    flops = {d: matmul_peak(device, d, n) for d in dtypes}
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    return DevicePeaks(name, flops, copy_bandwidth(device, nbytes), n, nbytes)


def step_cost(sets: list[str], device: Any, bf16: bool) -> StepCost:
    """FLOPs and the bytes model of one training step of the task ``sets`` configure."""
    import torch

    from convergent.config import load_config
    from convergent.monitor.flops import count_flops
    from convergent.train.tasks import make_task

    device = torch.device(device)
    task = make_task(load_config(None, sets))
    model = task.build_model().to(device)
    mb = task.to(task.micro_batches(0, 0, 1, 1)[0], device)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    def step() -> None:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, _ = task.loss(model, mb, 1)
        loss.backward()

    _, flops = count_flops(step)
    pbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return StepCost(int(mb.units), flops, sum(saved.values()), pbytes)


def fractions(units_per_s: float | None, cost: StepCost, peaks: DevicePeaks,
              dtype: str) -> dict[str, Any]:
    """Achieved FLOP/s and modelled bytes/s of a side, and their fractions of the peaks."""
    if not units_per_s:
        return {"matmul_fraction": None, "bandwidth_fraction": None}
    steps_per_s = units_per_s / cost.units
    achieved = cost.flops * steps_per_s
    moved = cost.bytes_model * steps_per_s
    return {"achieved_flops": achieved, "matmul_peak_dtype": dtype,
            "matmul_fraction": achieved / peaks.matmul_flops[dtype],
            "modelled_bytes_per_s": moved,
            "bandwidth_fraction": moved / peaks.copy_bytes_per_s}


# side -> (matmul peak dtype, whether the step runs under bf16 autocast)
SIDE_DTYPES = {"ours_bf16": ("bf16", True), "ours_bf16_compile": ("bf16", True),
               "ours_fp32": ("tf32", False), "plain_bf16_prebuilt": ("bf16", True)}


def part_fractions(part: dict[str, Any], costs: dict[bool, StepCost], peaks: DevicePeaks,
                   med: Any) -> dict[str, dict[str, Any]]:
    """Per side of a harness part: fractions of the measured peaks (``costs`` by bf16)."""
    out = {}
    for side, (dtype, bf16) in SIDE_DTYPES.items():
        if side not in part.get("summary", {}) or bf16 not in costs:
            continue
        peak = dtype if dtype in peaks.matmul_flops else "fp32"
        out[side] = fractions(med(part, side), costs[bf16], peaks, peak)
    return out


_PEAKS: list[DevicePeaks] = []  # measured once per run, at the first part that needs them


def with_fractions(part: dict[str, Any], sets: list[str], device: Any, med: Any
                   ) -> dict[str, Any]:
    """A harness ``part`` with the device's measured peaks (once per process), the step's
    cost for the task ``sets`` configure, and each side's fractions of the peaks; a failure
    here is recorded in the part, never fatal (the throughputs stand without it)."""
    try:
        if not _PEAKS:
            _PEAKS.append(measure_peaks(device))
        costs = {bf16: step_cost(sets, device, bf16) for bf16 in (True, False)}
        part["device_peaks"] = _PEAKS[0].record()
        part["step_cost"] = {"bf16" if k else "fp32": v.record() for k, v in costs.items()}
        part["fractions_of_peak"] = part_fractions(part, costs, _PEAKS[0], med)
    except Exception as exc:  # noqa: BLE001
        part["fractions_of_peak_error"] = f"{type(exc).__name__}: {exc}"[:500]
    return part


def fraction_keys(res: dict[str, Any]) -> dict[str, Any]:
    """gpu.json's top-level keys: ours bf16's fractions of the measured matmul peak and
    copy bandwidth per part, and the peaks."""
    out: dict[str, Any] = {}
    for part in ("molecular", "lm"):
        side = res.get(part, {}).get("fractions_of_peak", {}).get("ours_bf16", {})
        for k in ("matmul_fraction", "bandwidth_fraction"):
            out[f"{part}_{k}_bf16"] = side.get(k)
    out["device_peaks"] = next((res[p]["device_peaks"] for p in ("molecular", "lm")
                                if "device_peaks" in res.get(p, {})), None)
    return out
