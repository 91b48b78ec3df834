"""GPU benchmark part ``serve`` (issue 39 item 9): the engine on one GPU against
transformers' ``generate``, with where the time goes and how far from the floor.

The model: a random Llama 1.1B (22 layers, hidden 2048, GQA 32/4, vocab 32,000, bf16
weights). The trace: :func:`convergent.serve.workload.uniform_trace` — 1,000 requests,
prompts 128-1,024 and outputs 64-512 tokens drawn uniformly (seed 0), all at t=0,
every request run to its output length (EOS ignored). Sides, interleaved over rounds
(bench/lib/harness.py through ``bench.gpu.throughput._rounds``):

* ``ours_bf16`` / ``ours_fp32`` — our engine, one stage, interleaved scheduler, at most
  256 sequences a step and 8,192 batched tokens, the CUDA defaults (decode CUDA graphs,
  async scheduling, Triton paged decode), a KV budget that holds 256 x 1,536 tokens
  (+10%); output tokens/s after start-up, TTFT and TPOT p50/p99 (arrival = t=0), the
  step's split (host prepare, GPU by CUDA events, sync: :mod:`convergent.serve.timing`);
* ``ours_bf16_hf_subset`` — the bf16 engine on the requests transformers runs;
* ``hf_generate_bf16`` — transformers ``generate`` in bf16 (SDPA) on the trace's first
  ``--hf-requests`` requests (default 256: ~20x slower, the whole trace would not fit the
  lease) in static batches of ``--hf-batch`` (default 256, our concurrency), left padded,
  each batch to its longest output; only requested tokens count, over the wall time.

After the rounds (from the last bf16 round's records): the memory-bandwidth floor of
that run's steps at the measured copy bandwidth and the TD-Pipe vs interleaved projection
onto 4 PCIe GPUs (bench/gpu/serve_floor.py). Top-level keys: :func:`serve_keys`.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["MAX_BATCHED_TOKENS", "MAX_SEQS", "PROFILE_SEQS", "SERVE_SHAPE", "TRACE",
           "bench_serve", "hf_generate_run", "kv_budget_bytes", "ours_row", "post_rounds",
           "serve_cfg", "serve_keys", "serve_model"]

SERVE_SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                   num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                   max_position_embeddings=4096, bos_token_id=256, eos_token_id=257)
MAX_SEQS = 256
MAX_BATCHED_TOKENS = 8192
PROFILE_SEQS = 64  # serve_modes and bench.gpu.profile: the earlier 64-sequence setting
TRACE = dict(n=1000, seed=0, input_range=(128, 1024), output_range=(64, 512))
KV_HEADROOM = 1.1


def serve_model(tmp: Path, device: str = "cuda", shape: dict | None = None) -> Path:
    """The random Llama (``SERVE_SHAPE`` unless ``shape``), saved in bf16 under ``tmp``."""
    import torch

    from convergent.models.llama import LlamaConfig, LlamaForCausalLM, save_pretrained

    cfg = LlamaConfig(**(shape or SERVE_SHAPE))
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model.reset_parameters(std=0.02)
    name = "llama-1.1b" if shape is None else "llama-small"
    return save_pretrained(model.to(torch.bfloat16), tmp / name)


def kv_budget_bytes(mcfg: Any, dtype_bytes: int, seqs: int, tokens: int,
                    block_size: int = 16, headroom: float = KV_HEADROOM) -> int:
    """A KV budget that holds ``seqs`` sequences of ``tokens`` tokens each (whole blocks),
    times ``headroom``."""
    blocks = seqs * -(-tokens // block_size)
    return int(blocks * block_size * mcfg.kv_bytes_per_token(dtype_bytes=dtype_bytes) * headroom)


def serve_cfg(device: str, dtype: str, kv_bytes: int, seqs: int = MAX_SEQS,
              tokens: int = MAX_BATCHED_TOKENS) -> Any:
    """The engine's settings: one stage, interleaved, the device's defaults otherwise."""
    from convergent.serve.config import ServeConfig

    return ServeConfig(
        engine={"device": device, "dtype": dtype, "kv_budget_bytes": kv_bytes},
        scheduler={"kind": "interleaved", "stages": 1, "max_num_seqs": seqs,
                   "max_batched_tokens": tokens, "profile_costs": False})


def ours_row(res: dict[str, Any]) -> dict[str, Any]:
    """A side's row from ``run_trace``'s result: flat numbers (medians over rounds) and the
    step split as recorded."""
    split, lat = res["step_split"], res["token_latency"]
    return {"per_s": res["output_tok_s"], "wall_s": res["wall_s"], "setup_s": res["setup_s"],
            "output_tokens": res["output_tokens"], "steps": split["steps"],
            "kv_peak_blocks": res["kv_peak_blocks"], "kv_blocks": res["kv_blocks"],
            "preemptions": res["preemptions"], "decode_graph_steps": res["decode_graph_steps"],
            "mixed_graph_steps": res["mixed_graph_steps"],
            **{k: v for k, v in lat.items() if k != "requests"},
            **{f"{k}_fraction": split[f"{k}_fraction"] for k in ("host_prepare", "gpu", "sync")},
            "step_split": split, "outputs_digest": res["outputs_digest"]}


def hf_generate_run(mdir: Path, trace: list, batch: int, device: str = "cuda"
                    ) -> Callable[[], dict[str, Any]]:
    """transformers ``generate`` in bf16 over ``trace`` in static batches of ``batch``
    (left padding, greedy, each batch to its longest output); requested tokens / wall."""
    import torch
    import transformers

    from convergent.serve.tokenizer import ByteTokenizer

    hf = transformers.LlamaForCausalLM.from_pretrained(mdir, dtype=torch.bfloat16)
    hf = hf.to(device).eval()
    prompts = [ByteTokenizer(hf.config.vocab_size).encode(r.prompt) for r in trace]

    def run() -> dict[str, Any]:
        t0 = time.monotonic()
        useful = 0
        for i in range(0, len(trace), batch):
            chunk = list(range(i, min(i + batch, len(trace))))
            width = max(len(prompts[j]) for j in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.int64)
            mask = torch.zeros_like(ids)
            for r, j in enumerate(chunk):  # left padding
                ids[r, width - len(prompts[j]):] = torch.tensor(prompts[j])
                mask[r, width - len(prompts[j]):] = 1
            n = max(trace[j].output_len for j in chunk)
            with torch.no_grad():
                hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=n,
                            min_new_tokens=n, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
            useful += sum(trace[j].output_len for j in chunk)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        wall = time.monotonic() - t0
        return {"per_s": useful / wall, "wall_s": wall, "output_tokens": useful}

    return run


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def post_rounds(run: dict[str, Any], mdir: Path, trace: list, bytes_per_s: float,
                dtype_bytes: int = 2) -> dict[str, Any]:
    """The floor and the 4-GPU projection of one recorded run (``run_trace``'s result,
    with ``_batch_log`` and ``_step_device_s``)."""
    from bench.gpu.serve_floor import bandwidth_floor, project_pipeline, step_weight_bytes
    from convergent.models.llama import read_config
    from convergent.serve.config import SchedulerConfig

    mcfg = read_config(mdir)
    log = run["_batch_log"]
    floor = bandwidth_floor([e["shape"] for e in log.values()], run["output_tokens"],
                            step_weight_bytes(mcfg, dtype_bytes),
                            mcfg.kv_bytes_per_token(dtype_bytes=dtype_bytes), bytes_per_s)
    # the fraction of this (last bf16) run; serve_fraction_of_floor takes the median's
    out: dict[str, Any] = {"floor": floor.to_dict(), "fraction_of_floor_last_round":
                           run["output_tok_s"] / floor.tok_s if floor.tok_s else None}
    split = run["step_split"]
    sched = SchedulerConfig(max_num_seqs=MAX_SEQS, max_batched_tokens=MAX_BATCHED_TOKENS)
    try:
        out["projection"] = project_pipeline(
            log, run["_step_device_s"], split["host_prepare_s"] / max(1, split["steps"]),
            [(r.input_len, r.output_len, r.output_len) for r in trace], mcfg,
            4 * run["kv_blocks"], 16, sched)
        out["projection"]["assumptions"]["kv"] = ("each GPU gives the measured run's KV bytes to "
                                                  "its quarter of the layers: 4x the blocks")
    except Exception as exc:  # noqa: BLE001 - the measured numbers must survive
        out["projection"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    return out


def bench_serve(tmp: Path, rounds: int, hf_requests: int = 256, hf_batch: int = 256,
                device: str = "cuda", shape: dict | None = None, trace: list | None = None
                ) -> dict[str, Any]:
    """The part (see the module's docstring); ``device``/``shape``/``trace`` for a small
    run elsewhere (the tests run the pure pieces on the CPU)."""
    from bench.gpu.peaks import copy_bandwidth
    from bench.gpu.throughput import _rounds
    from convergent.models.llama import read_config
    from convergent.serve.offline import run_trace
    from convergent.serve.workload import uniform_trace

    mdir = serve_model(tmp, device, shape)
    mcfg = read_config(mdir)
    trace = trace or uniform_trace(**TRACE)
    subset = trace[:hf_requests]
    longest = max(r.input_len + r.output_len for r in trace)
    last: dict[str, Any] = {}

    def ours(dtype: str, reqs: list, keep: bool) -> Callable[[], dict]:
        kv = kv_budget_bytes(mcfg, 2 if dtype == "bfloat16" else 4, MAX_SEQS, longest)
        cfg = serve_cfg(device, dtype, kv)

        def run() -> dict:
            res = run_trace(mdir, cfg, reqs)
            if keep:
                last.clear()
                last.update(res)
            row = ours_row(res)
            del res
            _free()
            return row

        return run

    sides = {"ours_bf16": ours("bfloat16", trace, True), "ours_fp32": ours("float32", trace, False),
             "ours_bf16_hf_subset": ours("bfloat16", subset, False),
             f"hf_generate_bf16_batch{hf_batch}": hf_generate_run(mdir, subset, hf_batch, device)}
    part = _rounds("gpu.serve", sides, _settings(trace, subset, hf_batch, longest), rounds,
                   _differences(len(trace), len(subset), hf_batch))
    import torch

    if last:
        bw = copy_bandwidth(torch.device(device), 2**30 if device.startswith("cuda") else 2**26)
        part.update(post_rounds(last, mdir, trace, bw))
    return part


def _settings(trace: list, subset: list, hf_batch: int, longest: int) -> dict[str, dict]:
    common = {"model": "random Llama 1.1B (22 layers, hidden 2048, GQA 32/4, vocab 32000)",
              "trace": f"uniform_trace({TRACE}): all at t=0, EOS ignored",
              "requests": len(trace), "output_tokens": sum(r.output_len for r in trace),
              "sampling": "greedy"}
    eng = (f"convergent engine, 1 stage, interleaved, max_num_seqs {MAX_SEQS}, "
           f"{MAX_BATCHED_TOKENS} batched tokens, KV for {MAX_SEQS} x {longest} tokens "
           f"(+{KV_HEADROOM - 1:.0%}), CUDA defaults (decode graphs, async scheduling, Triton)")
    sub = {**common, "requests": len(subset), "output_tokens": sum(r.output_len for r in subset),
           "subset": f"the trace's first {len(subset)} requests"}
    return {"ours_bf16": {**common, "side": f"{eng}, bf16"},
            "ours_fp32": {**common, "side": f"{eng}, fp32"},
            "ours_bf16_hf_subset": {**sub, "side": f"{eng}, bf16"},
            f"hf_generate_bf16_batch{hf_batch}": {
                **sub, "side": f"transformers generate, bf16, SDPA, static batches of "
                               f"{hf_batch}, left padding"}}


def _differences(n: int, n_hf: int, hf_batch: int) -> list[str]:
    return [f"transformers generate runs the trace's first {n_hf} of {n} requests (it is ~20x "
            "slower: the whole trace would not fit the lease); serve_vs_hf_generate divides ours "
            "on all requests by it, serve_vs_hf_generate_same_requests ours on the same subset "
            "(ours_bf16_hf_subset); tok/s is requested output tokens over the wall time for both",
            f"ours batches continuously (up to {MAX_SEQS} sequences, a finished one replaced at "
            f"once); generate runs static batches of {hf_batch}, each to its longest output",
            "ours' wall time starts after the engine's start-up (model load, graph capture: "
            "setup_s); generate's after the model is loaded",
            "ours_fp32 runs fp32 (full-precision matmuls, no TF32), the others bf16"]


def serve_keys(part: dict[str, Any], med: Callable, ratio: Callable) -> dict[str, Any]:
    """The top-level keys of the ``serve`` part."""
    hf = next((k for k in part.get("summary", {}) if k.startswith("hf_generate")), "hf")
    bf16 = med(part, "ours_bf16")
    rows = [r for r in part.get("per_round", {}).get("ours_bf16", []) if "step_split" in r]
    split = min(rows, key=lambda r: abs(r["per_s"] - bf16))["step_split"] if rows else None
    proj = part.get("projection") or {}
    return {
        "serve_output_tok_s_bf16": bf16,
        "serve_output_tok_s_fp32": med(part, "ours_fp32"),
        "serve_bf16_speedup_vs_fp32": ratio(bf16, med(part, "ours_fp32")),
        "serve_vs_hf_generate": ratio(bf16, med(part, hf)),
        "serve_vs_hf_generate_same_requests": ratio(med(part, "ours_bf16_hf_subset"), med(part, hf)),
        **{f"serve_{k}": med(part, "ours_bf16", k)
           for k in ("ttft_s_p50", "ttft_s_p99", "tpot_s_p50", "tpot_s_p99")},
        "serve_step_split": split,
        "serve_bandwidth_floor_tok_s": (part.get("floor") or {}).get("tok_s"),
        "serve_fraction_of_floor": ratio(bf16, (part.get("floor") or {}).get("tok_s")),
        "serve_projection_4gpu_pcie": {k: proj.get(k) for k in
                                       ("tdpipe_tok_s", "interleaved_tok_s", "ratio",
                                        "assumptions", "error") if k in proj} or None,
    }
