"""GPU benchmark part ``serve_modes``: the serving engine's CUDA graphs (decode graphs and
the piecewise graphs of the mixed steps) and async scheduling, on and off, on the serving
part's model and trace (issue 39 items 2 and 4).

Five sides, one engine each (bench/gpu/serve.py's 1.1B random Llama, the
``make_trace(256, seed=0)`` trace scaled 0.5, bf16, one stage, interleaved scheduler, at
most 64 sequences, 16 GiB KV, decode attention ``auto`` = Triton):
``graphs_async`` (``serve.engine.cuda_graphs=on``, ``async_scheduling=on``: the CUDA
default), ``decode_graphs_async`` (``serve.engine.mixed_graphs=off``: the engine at
4e3e605, mixed steps eager), ``graphs_sync``, ``eager_async`` and ``eager_sync`` (all off:
the engine before these items). Output tokens/s after start-up (``setup_s``, which holds the graphs'
capture, is reported beside it, with the decode steps that ran as graphs and a digest of
the outputs: bf16 tokens may differ between graphs and eager where the padded GEMMs round
differently near a tie). Run as a part of the GPU benchmark:
``python -m bench.gpu.throughput --only serve_modes --serve-rounds 2`` (~3 min on an H100),
which writes it under ``serve_modes`` of ``bench/results/gpu.json`` with the top-level
``serve_graphs_speedup`` (graphs_async / eager_sync) computed by the caller from the
summary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["MODES", "bench_serve_modes", "graphs_speedup"]

# side -> (serve.engine.cuda_graphs, serve.engine.mixed_graphs, serve.engine.async_scheduling)
MODES = {"graphs_async": ("on", "auto", "on"), "decode_graphs_async": ("on", "off", "on"),
         "graphs_sync": ("on", "auto", "off"), "eager_async": ("off", "auto", "on"),
         "eager_sync": ("off", "auto", "off")}


def bench_serve_modes(tmp: Path, rounds: int) -> dict[str, Any]:
    """The sides over ``rounds`` interleaved rounds (bench/lib/harness.py)."""
    from bench.gpu.serve import PROFILE_SEQS, serve_model
    from bench.gpu.throughput import _rounds
    from convergent.serve.config import ServeConfig
    from convergent.serve.offline import run_trace
    from convergent.serve.workload import make_trace, scale_trace

    mdir = serve_model(tmp)
    trace = scale_trace(make_trace(256, seed=0), 0.5)

    def side(graphs: str, mixed: str, asyn: str):
        cfg = ServeConfig(
            engine={"device": "cuda", "dtype": "bfloat16", "kv_budget_bytes": 16 * 2**30,
                    "cuda_graphs": graphs, "mixed_graphs": mixed, "async_scheduling": asyn},
            scheduler={"kind": "interleaved", "stages": 1, "max_num_seqs": PROFILE_SEQS,
                       "max_batched_tokens": 8192, "profile_costs": False})

        def run() -> dict:
            res = run_trace(mdir, cfg, trace)
            return {"per_s": res["output_tok_s"], "wall_s": res["wall_s"],
                    "setup_s": res["setup_s"], "decode_graph_steps": res["decode_graph_steps"],
                    "mixed_graph_steps": res["mixed_graph_steps"],
                    "by_kind": res["step_split"].get("by_kind"),
                    "outputs_digest": res["outputs_digest"]}

        return run

    sides = {name: side(*m) for name, m in MODES.items()}
    common = {"model": "random Llama 1.1B (22 layers, hidden 2048, GQA 32/4, vocab 32000)",
              "trace": "make_trace(256, seed=0) scaled 0.5", "requests": len(trace),
              "engine": "1 stage, interleaved, bf16, 16 GiB KV, 8192 batched tokens, "
                        f"max_num_seqs {PROFILE_SEQS}, attention_backend auto (Triton)"}
    settings = {name: {**common, "cuda_graphs": g, "mixed_graphs": m, "async_scheduling": a}
                for name, (g, m, a) in MODES.items()}
    diffs = ["only serve.engine.cuda_graphs, mixed_graphs and async_scheduling differ",
             "setup_s (start-up, with the graphs' capture) is not in per_s"]
    return _rounds("gpu.serve_modes", sides, settings, rounds, diffs)


def graphs_speedup(part: dict[str, Any], med) -> dict[str, float | None]:
    """Top-level keys: each side's tokens/s relative to ``eager_sync``."""
    base = med(part, "eager_sync")
    return {f"serve_{name}_vs_eager_sync": (med(part, name) / base if base and med(part, name)
                                            else None)
            for name in MODES if name != "eager_sync"}
