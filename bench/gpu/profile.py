"""Where the GPU time goes: torch.profiler tables for the shapes of bench/gpu/throughput.py.

Not a benchmark (no sides, no rounds): a diagnostic for the next change. It profiles

* a few molecular training steps (hidden 256, 6 layers, ``--mol-atoms`` atoms, autograd
  forces, the batches prebuilt on the GPU) in fp32 (TF32) and under bf16 autocast, the
  attention's message step by ``--edge-kernel`` (``model.edge_kernel``, default ``auto``:
  torch in training), and
* our serving engine on the first ``--requests`` requests of the bench-serve trace with the
  1.1B random Llama of bench/gpu/throughput.py, in bf16 (decode attention
  ``--attention-backend``, default ``auto``: Triton on CUDA), after a short micro-benchmark
  of that model's decode attention, gather + SDPA vs Triton vs FlexAttention
  (bench/gpu/attention.py, result key ``serve_attention``, within ~30 s),

and writes, per part, the top operators by CUDA time and by CPU time, the share of the
profiled wall time the GPU was busy, and the kernels' count, to ``--out`` (JSON) and
stdout. Needs CUDA; on a machine without it, one line and exit code 2.

Usage: ``python -m bench.gpu.profile [--mol-atoms 16384] [--edge-kernel auto] [--requests 64]
[--max-output 48] [--attention-backend auto] [--cuda-graphs auto] [--async-scheduling auto]
[--only molecular,serve] [--out F]`` (on CUDA ``auto`` captures the decode steps as CUDA
graphs and overlaps the host's work: ``--cuda-graphs off --async-scheduling off`` profiles
the eager engine of the same commit)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.gpu.attention import decode_attention_bench
from bench.lib.harness import provenance

ROWS = 20


def _table(prof: Any, key: str) -> list[dict[str, Any]]:
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:ROWS]:
        rows.append({"op": e.key[:90], "calls": e.count,
                     "self_cuda_ms": round(getattr(e, "self_device_time_total", 0) / 1e3, 3),
                     "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3)})
    return rows


def _summary(prof: Any, wall_s: float) -> dict[str, Any]:
    evs = [e for e in prof.events() if e.device_type.name == "CUDA"]  # kernels, copies
    busy = sum(e.time_range.elapsed_us() for e in evs) / 1e6  # one stream: no overlap
    return {"wall_s": round(wall_s, 4), "kernels": len(evs),
            "gpu_busy_s_upper": round(busy, 4),
            "top_by_cuda": _table(prof, "self_device_time_total"),
            "top_by_cpu": _table(prof, "self_cpu_time_total")}


def profile_molecular(tmp: Path, atoms: int, steps: int = 3,
                      edge_kernel: str = "auto") -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.gpu.throughput import LR, make_molecules
    from convergent.config import load_config
    from convergent.train.tasks import make_task

    data = make_molecules(tmp / "mol", max(64, 2 * atoms // 6))
    cfg = load_config(None, [f"train.dataset={data}", "model.hidden=256", "model.layers=6",
                             f"train.global_batch_atoms={atoms}", f"model.edge_kernel={edge_kernel}"])
    task = make_task(cfg)
    dev = torch.device("cuda")
    batches = [task.to(task.micro_batches(s, 0, 1, 1)[0], dev) for s in range(2)]
    torch.backends.cuda.matmul.allow_tf32 = True
    out = {}
    for dtype in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = task.build_model().to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)

        def step(i: int, model=model, opt=opt, dtype=dtype) -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                loss, _ = task.loss(model, batches[i % 2], 1)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for i in range(3):
            step(i)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for i in range(steps):
                step(i)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        out[dtype] = {"steps": steps, "atoms_per_batch": batches[0].units, "edge_kernel": edge_kernel,
                      "atoms_per_s": round(steps * batches[0].units / wall), **_summary(prof, wall)}
        del model, opt
    return out


def profile_serve(tmp: Path, requests: int, max_output: int, backend: str = "auto",
                  graphs: str = "auto", asyn: str = "auto") -> dict[str, Any]:
    import dataclasses

    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.gpu.serve import PROFILE_SEQS, serve_model
    from convergent.serve.config import ServeConfig
    from convergent.serve.offline import run_trace
    from convergent.serve.workload import make_trace, scale_trace

    mdir = serve_model(tmp)
    # Outputs capped: the profiler keeps every CPU op and kernel, and a whole trace (~500
    # decode steps x 22 layers x ~25 kernels) took minutes to collect on an H100 (2026-11-26).
    trace = [dataclasses.replace(r, output_len=min(r.output_len, max_output))
             for r in scale_trace(make_trace(256, seed=0), 0.5)[:requests]]
    cfg = ServeConfig(
        engine={"device": "cuda", "dtype": "bfloat16", "kv_budget_bytes": 16 * 2**30,
                "attention_backend": backend, "cuda_graphs": graphs, "async_scheduling": asyn},
        scheduler={"kind": "interleaved", "stages": 1, "max_num_seqs": PROFILE_SEQS,
                   "max_batched_tokens": 8192, "profile_costs": False})
    run_trace(mdir, cfg, trace[:8])  # warm-up: kernels, allocator
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        res = run_trace(mdir, cfg, trace)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return {"requests": len(trace), "max_output": max_output, "attention_backend": backend,
            "cuda_graphs": graphs, "async_scheduling": asyn,
            "output_tokens": sum(r.output_len for r in trace),
            "output_tok_s_profiled": res["output_tok_s"], **_summary(prof, wall)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mol-atoms", type=int, default=16384)
    ap.add_argument("--edge-kernel", default="auto", choices=["auto", "torch", "triton", "index"],
                    help="molecular: model.edge_kernel of the profiled model")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-output", type=int, default=48,
                    help="serving: cap each request's output tokens (bounds the profile's size)")
    ap.add_argument("--attention-backend", default="auto",
                    choices=["auto", "sdpa_gather", "triton", "flex"],
                    help="serving: serve.engine.attention_backend of the profiled engine")
    ap.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"],
                    help="serving: serve.engine.cuda_graphs (decode steps as CUDA graphs)")
    ap.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"],
                    help="serving: serve.engine.async_scheduling")
    ap.add_argument("--only", default="molecular,serve")
    ap.add_argument("--out", type=Path, default=Path("gpu_profile.json"))
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu/profile.py needs a CUDA GPU (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    res: dict[str, Any] = {"provenance": provenance(), "device": torch.cuda.get_device_name(0),
                           "torch": torch.__version__}
    with tempfile.TemporaryDirectory(prefix="convergent-gpu-profile-") as d:
        steps = {"molecular": [("molecular", lambda: profile_molecular(
                     Path(d), args.mol_atoms, edge_kernel=args.edge_kernel))],
                 # the decode-attention micro-benchmark first: short, and what decides the backend
                 "serve": [("serve_attention", lambda: decode_attention_bench("cuda")),
                           ("serve", lambda: profile_serve(Path(d), args.requests, args.max_output,
                                                           args.attention_backend, args.cuda_graphs,
                                                           args.async_scheduling))]}
        for key, fn in [x for part in args.only.split(",") for x in steps[part]]:
            try:
                res[key] = fn()
            except Exception as exc:  # noqa: BLE001 - one failing part must not lose the other
                res[key] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            args.out.write_text(json.dumps(res, indent=1))
            print(json.dumps({key: res[key]}, indent=1)[:6000], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
