"""The edge-kernel part of bench/gpu/throughput.py (``--only edge``; issue 42 item 2).

``model.edge_kernel`` ``index`` (the pre-CSR scatter, ``index_add_``), ``torch`` (segment
sums over receiver-sorted edges) and ``triton`` (the fused kernel), each in fp32 (TF32) and
under bf16 autocast, on the molecular model of the molecular part (hidden 256, 6 layers,
``--mol-atoms`` atoms a batch): training steps (autograd forces, so a double backward;
AdamW) and, for torch and triton, inference (energies and forces, first-order backward
only, as MD and screening run). Each side is a plain loop over the same two batches
prebuilt on the GPU (no input pipeline), CUDA-event timed, medians over the steps after
the warm-up; the sides interleave over rounds (bench/lib/harness.py). About a minute and a
half on an H100 with the defaults (3 rounds, 12 steps).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

KERNELS = ("index", "torch", "triton")


def _edge_side(task: Any, batches: list, steps: int, warmup: int, dtype: str,
               infer: bool) -> Callable[[], dict]:
    """The plain loop on prebuilt batches for one ``model.edge_kernel`` (``task``'s config):
    a training step (autograd forces, double backward, AdamW), or ``infer``: energies and
    forces without a graph (the first-order backward only, as MD and screening run)."""
    import torch

    from bench.gpu.steps import cuda_timed
    from bench.gpu.throughput import LR
    from convergent.models.molecular import energy_and_forces

    def run() -> dict:
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 sides: TF32, as the trainer
        torch.manual_seed(0)
        model = task.build_model().to("cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
        model.train(not infer)
        def step(i: int) -> float:
            mb = batches[i % len(batches)]
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                if infer:
                    energy_and_forces(model, mb.data, training=False)
                else:
                    loss, _ = task.loss(model, mb, 1)
            if not infer:
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return mb.units

        return cuda_timed(step, steps, warmup)

    return run


def bench_edge_kernel(tmp: Path, rounds: int, steps: int, atoms: int) -> dict[str, Any]:
    """``model.edge_kernel`` index / torch / triton in fp32 and bf16, training steps and
    inference (energies + forces), each on the same prebuilt batches (issue 42 item 2)."""
    import torch

    from bench.gpu.throughput import _rounds, make_molecules
    from convergent.config import load_config
    from convergent.train.tasks import make_task

    data = make_molecules(tmp / "mol", max(64, 2 * atoms // 6))
    dev = torch.device("cuda")
    sides: dict[str, Callable[[], dict]] = {}
    settings: dict[str, dict] = {}
    batches = None
    warmup = min(5, steps // 3)
    for kernel in KERNELS:
        task = make_task(load_config(None, [
            f"train.dataset={data}", "model.hidden=256", "model.layers=6",
            f"train.global_batch_atoms={atoms}", f"model.edge_kernel={kernel}"]))
        batches = batches or [task.to(task.micro_batches(s, 0, 1, 1)[0], dev) for s in range(2)]
        for dtype in ("fp32", "bf16"):
            for infer in (False, True):
                if infer and kernel == "index":
                    continue
                name = f"{kernel}_{dtype}_{'infer' if infer else 'train'}"
                sides[name] = _edge_side(task, batches, steps, warmup, dtype, infer)
                settings[name] = {
                    "model": "molecular, hidden 256, 6 layers, 4 heads (head width 64)",
                    "edge_kernel": kernel, "dtype": dtype, "batch_atoms": atoms,
                    "steps": steps, "timed_steps": f"{warmup}..{steps}",
                    "side": ("energies + forces, no graph (first-order backward)" if infer else
                             "training step: autograd forces (double backward), AdamW")}
    diffs = ["index: the pre-CSR scatter (index_add_) path; torch: segment sums over "
             "receiver-sorted edges; triton: the fused kernel (training: its backward is "
             "recomputed with torch ops where it is differentiated)",
             "fp32 sides use TF32 matmuls, bf16 sides autocast",
             "2 prebuilt batches on the GPU, reused (no input pipeline)"]
    return _rounds("gpu.edge_kernel", sides, settings, rounds, diffs)


def edge_keys(edge: dict[str, Any], med: Callable[..., Any], ratio: Callable[..., Any]) -> dict[str, Any]:
    """The part's top-level keys of gpu.json (None where a side is missing or failed)."""
    return {
        "edge_train_atoms_per_s_bf16": {k: med(edge, f"{k}_bf16_train") for k in KERNELS},
        "edge_torch_vs_index_train_bf16": ratio(med(edge, "torch_bf16_train"),
                                                med(edge, "index_bf16_train")),
        "edge_triton_vs_torch_train_bf16": ratio(med(edge, "triton_bf16_train"),
                                                 med(edge, "torch_bf16_train")),
        "edge_triton_vs_torch_infer_bf16": ratio(med(edge, "triton_bf16_infer"),
                                                 med(edge, "torch_bf16_infer")),
        "edge_bf16_vs_fp32_train": {k: ratio(med(edge, f"{k}_bf16_train"),
                                             med(edge, f"{k}_fp32_train")) for k in KERNELS},
    }
