"""Offline serving throughput: sequential vs interleaved (+/- chunked prefill) vs TD-Pipe
(oracle / learned / constant output-length predictor) on a 2-stage CPU pipeline, plus
transformers' ``generate`` as the peer a CPU user would reach for; the discrete-event
simulator replays every run from the start-up cost table (error reported) and projects
4-GPU throughput from a spec-derived L20 cost table next to the paper's figures.

Every run's engine profiles its cost table *in situ* at start-up (a short sweep of
prefill/decode shapes through its own stage processes, both stages active: per-stage
time models, dispatch / hop / return latencies and each stage's turnaround between
back-to-back micro-batches); TD-Pipe's switch rule and the simulator replay of that run
use it, and the replay also charges the scheduler's own decision time (timed as it
runs). The older one-process layer profile is kept only to report its (larger)
simulator error for comparison.

    python bench/serve_throughput.py        # defaults: 500 requests, prompts x0.5, outputs x0.125
    python bench/serve_throughput.py --requests 64 --quick
    python bench/serve_throughput.py --only interleaved,tdpipe_learned --repeat 2 --quick
    python bench/serve_throughput.py --dispatch      # dispatcher: 2 instances vs 1, routing,
                                                     # overhead, failover -> serve_dispatch.json

Writes bench/results/serve_throughput.json and bench/results/serve_kv_usage.png.
All runs share the same model (random ~30M-parameter Llama, HF format), the same trace
and the same KV budget. The CPU is shared with other jobs: numbers are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "src"))


def _versions() -> dict:
    import numpy
    import torch

    v = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
    }
    try:
        import transformers

        v["transformers"] = transformers.__version__
    except ImportError:
        pass
    return v


def _machine() -> dict:
    from convergent.resources import usable_cpus

    info = {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "usable_cpus": usable_cpus(),
    }
    try:
        info["loadavg_start"] = os.getloadavg()
    except OSError:
        pass
    try:
        import psutil

        info["mem_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    return info


def hf_generate_peer(model_dir: Path, trace, batch_size: int, threads: int) -> dict:
    """transformers LlamaForCausalLM.generate (greedy, left-padded batches in trace order).

    Each batch runs to its longest requested output; only requested tokens are counted.
    """
    import torch
    import transformers

    from convergent.serve.tokenizer import ByteTokenizer

    torch.set_num_threads(threads)
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = ByteTokenizer(model.config.vocab_size)
    n_in = n_out = 0
    t0 = time.monotonic()
    with torch.inference_mode():
        for i in range(0, len(trace), batch_size):
            chunk = trace[i : i + batch_size]
            ids = [tok.encode(r.prompt) for r in chunk]
            width = max(len(x) for x in ids)
            inp = torch.zeros(len(ids), width, dtype=torch.long)
            mask = torch.zeros(len(ids), width, dtype=torch.long)
            for j, x in enumerate(ids):
                inp[j, width - len(x) :] = torch.tensor(x)
                mask[j, width - len(x) :] = 1
            mx = max(r.output_len for r in chunk)
            model.generate(
                inp,
                attention_mask=mask,
                max_new_tokens=mx,
                min_new_tokens=mx,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
            n_in += sum(len(x) for x in ids)
            n_out += sum(r.output_len for r in chunk)
    wall = time.monotonic() - t0
    return {
        "requests": len(trace),
        "batch_size": batch_size,
        "threads": threads,
        "wall_s": wall,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "req_s": len(trace) / wall,
        "output_tok_s": n_out / wall,
        "total_tok_s": (n_in + n_out) / wall,
    }


def decode_step_profile(model_dir: Path, stages: int, block_size: int = 16) -> dict:
    """Per-stage decode step (one micro-batch) at batch 8/32/128, mean context 64
    (contexts 16..112): best-of-7 wall and thread CPU time in ms, and per token."""
    import random

    import torch

    from convergent.serve.stage import BatchMeta, StageRunner, StageSpec

    runners = [
        StageRunner(StageSpec(str(model_dir), s, stages, 2048, block_size)) for s in range(stages)
    ]
    rng = random.Random(0)
    out = {}
    for b in (8, 32, 128):
        ctx = [rng.randint(16, 112) for _ in range(b)]
        tables, slots, nxt = [], [], 0
        for c in ctx:
            nb = -(-c // block_size)
            tables.append(list(range(nxt, nxt + nb)))
            nxt += nb
            slots.append(tables[-1][(c - 1) // block_size] * block_size + (c - 1) % block_size)
        meta = BatchMeta(
            0, [5] * b, [c - 1 for c in ctx], slots, [1] * b, ctx, tables,
            list(range(b)), list(range(b)), [0.0] * b, [0] * b,
        )  # fmt: skip
        row = {}
        for r in runners:
            x = None if r.first else torch.randn(b, r.config.hidden_size)
            walls, cpus = [], []
            for i in range(9):
                w, c = time.perf_counter(), time.thread_time()
                r.run(meta, x)
                if i >= 2:
                    walls.append(time.perf_counter() - w)
                    cpus.append(time.thread_time() - c)
            row[f"stage{r.spec.stage}"] = {
                "wall_ms": min(walls) * 1e3,
                "cpu_ms": min(cpus) * 1e3,
                "cpu_us_per_token": min(cpus) / b * 1e6,
            }
        out[str(b)] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument(
        "--scale",
        type=float,
        default=None,
        help="scale prompt and output lengths alike (overrides the two below)",
    )
    ap.add_argument(
        "--input-scale",
        type=float,
        default=0.5,
        help="scale of ShareGPT-like prompt lengths (1.0 = full; median ~33 tokens at 0.5)",
    )
    ap.add_argument(
        "--output-scale",
        type=float,
        default=0.125,
        help="scale of output lengths (CPU time budget; median ~40 tokens at 0.125)",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kv-tokens", type=int, default=4096, help="KV budget in tokens")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--chunk-tokens", type=int, default=128, help="chunked-prefill budget")
    ap.add_argument("--hf-requests", type=int, default=64, help="requests for the HF peer")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument(
        "--hf-threads",
        type=int,
        default=1,
        help="torch threads of the HF peer (1: oversubscribed CPUs punish more)",
    )
    ap.add_argument("--no-projection", action="store_true", help="skip the GPU projection")
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--only", default="", help="comma list of run names")
    ap.add_argument("--quick", action="store_true", help="skip the HF peer and projection")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the configurations this many times, alternating the order; "
        "report the median (the CPU is shared: load changes over time)",
    )
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    ap.add_argument(
        "--dispatch",
        action="store_true",
        help="instead: the dispatcher benchmark (bench/serve_dispatch.py) -> serve_dispatch.json",
    )
    ap.add_argument("--rounds", type=int, default=3, help="--dispatch: interleaved rounds")
    args = ap.parse_args(argv)
    if args.dispatch:
        from serve_dispatch import run as run_dispatch

        from convergent.serve.offline import ensure_random_model

        mdir = args.model_dir or Path(tempfile.gettempdir()) / "convergent-serve-30m"
        ensure_random_model(mdir, "30m", seed=0)
        res = run_dispatch(
            mdir,
            args.out / f"serve_dispatch{args.tag}.json",
            args.rounds,
            min(args.requests, 48),
            args.quick,
        )
        print(
            json.dumps({k: res[k] for k in ("throughput", "routing", "overhead")}, default=str)[
                :3000
            ]
        )
        return 0

    import torch

    from convergent.fsutil import atomic_write_text
    from convergent.models.llama import read_config
    from convergent.serve.config import ServeConfig
    from convergent.serve.costs import CostTable, calibrate_from_run, profile_costs
    from convergent.serve.offline import ensure_random_model, plot_kv_timeline, run_trace
    from convergent.serve.predictor import make_predictor
    from convergent.serve.scheduler import SchedulerConfig
    from convergent.serve.sim import project_gpu, simulate
    from convergent.serve.stage import split_layers
    from convergent.serve.workload import make_trace, scale_trace, trace_stats

    torch.set_num_threads(1)
    machine = _machine()  # load average at the start
    model_dir = args.model_dir or Path(tempfile.gettempdir()) / "convergent-serve-30m"
    ensure_random_model(model_dir, "30m", seed=0)
    mcfg = read_config(model_dir)
    full_trace = make_trace(args.requests, seed=args.seed)
    in_scale = args.input_scale if args.scale is None else args.scale
    out_scale = args.output_scale if args.scale is None else args.scale
    trace = scale_trace(full_trace, in_scale, output_scale=out_scale)
    kv_budget = args.kv_tokens * mcfg.kv_bytes_per_token()
    layers = [len(x) for x in split_layers(mcfg.num_hidden_layers, args.stages)]
    print(
        f"model {mcfg.n_params / 1e6:.1f}M params, {len(trace)} requests, "
        f"KV budget {kv_budget / 2**20:.1f} MiB ({args.kv_tokens} tokens)",
        flush=True,
    )

    step_profile = decode_step_profile(model_dir, args.stages)
    for b, row in step_profile.items():
        print(
            f"decode step batch {b:>3}: "
            + ", ".join(f"{k} {v['cpu_ms']:.1f} ms cpu" for k, v in row.items()),
            flush=True,
        )
    t = time.monotonic()
    costs_isolated = profile_costs(mcfg, layers, 16)
    print(f"one-process cost table profiled in {time.monotonic() - t:.1f} s", flush=True)

    predictors = {
        k: make_predictor(k, length_scale=out_scale, input_scale=in_scale)
        for k in ("oracle", "learned", "constant")
    }
    test_acc = predictors["learned"].accuracy(
        [r.prompt for r in trace], [r.output_len for r in trace]
    )

    base = dict(
        stages=args.stages,
        kv_budget_bytes=kv_budget,
        block_size=16,
        max_num_seqs=256,
        max_batched_tokens=args.max_batched_tokens,
        max_model_len=4096,
        profile_costs=True,
    )
    runs_spec = {
        "sequential": (ServeConfig(scheduler="sequential", **base), None),
        "interleaved": (ServeConfig(scheduler="interleaved", **base), None),
        "interleaved_chunked": (
            ServeConfig(
                scheduler="interleaved",
                chunked_prefill=True,
                **{**base, "max_batched_tokens": args.chunk_tokens},
            ),
            None,
        ),
        "tdpipe_oracle": (ServeConfig(scheduler="tdpipe", **base), "oracle"),
        "tdpipe_learned": (ServeConfig(scheduler="tdpipe", **base), "learned"),
        "tdpipe_constant": (ServeConfig(scheduler="tdpipe", **base), "constant"),
    }
    if args.only:
        keep = set(args.only.split(","))
        runs_spec = {k: v for k, v in runs_spec.items() if k in keep}
    calib: dict[str, CostTable] = {}

    def _one_run(name, spec, rep):
        cfg, pred_name = spec
        pred = predictors[pred_name] if pred_name else None
        t = time.monotonic()
        res = run_trace(model_dir, cfg, trace, predictor=pred, profile=True)
        res["predictor"] = pred_name
        costs = CostTable(**res["cost_table"])  # this run's in-situ start-up profile
        # simulator replay of the same run from the cost table
        reqs = [
            (
                r.input_len,
                r.output_len,
                pred.predict(r.prompt, r.output_len) if pred else r.output_len,
            )
            for r in trace
        ]
        scfg = SchedulerConfig.from_serve(cfg)
        nb = res["kv_blocks"]
        sim = simulate(cfg.scheduler, reqs, costs, nb, 16, scfg, time_decisions=True)
        res["sim"] = sim.to_dict()
        res["sim_error"] = abs(sim.makespan_s - res["wall_s"]) / res["wall_s"]
        sim_iso = simulate(
            cfg.scheduler,
            reqs,
            costs_isolated.with_stages(layers),
            nb,
            16,
            scfg,
            time_decisions=True,
        )
        res["sim_isolated_profile_error"] = abs(sim_iso.makespan_s - res["wall_s"]) / res["wall_s"]
        own = calibrate_from_run(
            res["_batch_log"],
            costs.with_stages(layers if cfg.scheduler != "sequential" else [sum(layers)]),
        )
        sim_own = simulate(cfg.scheduler, reqs, own, nb, 16, scfg, time_decisions=True)
        res["sim_self_calibrated"] = sim_own.to_dict()
        res["sim_self_calibrated_error"] = abs(sim_own.makespan_s - res["wall_s"]) / res["wall_s"]
        if name == "interleaved" and "pipeline" not in calib:
            calib["pipeline"] = own
        if cfg.scheduler != "sequential" and "pipeline" in calib:
            sim_x = simulate(
                cfg.scheduler, reqs, calib["pipeline"], nb, 16, scfg, time_decisions=True
            )
            res["sim_cross_calibrated"] = sim_x.to_dict()
            res["sim_cross_calibrated_error"] = (
                abs(sim_x.makespan_s - res["wall_s"]) / res["wall_s"]
            )
        res["_reqs"] = reqs
        res["_scfg"] = scfg
        st = ", ".join(f"s{s['stage']} busy {s['busy_fraction']:.0%}" for s in res["stages"])
        print(
            f"{name:20s} {res['output_tok_s']:7.1f} out tok/s  {res['req_s']:.2f} req/s  "
            f"wall {res['wall_s']:.0f} s  {st}  preempt {res['preemptions']}  "
            f"KV peak {res['kv_peak_blocks']}/{nb}  sim err in-situ {res['sim_error']:.1%} "
            f"one-process {res['sim_isolated_profile_error']:.1%} "
            f"self-cal {res['sim_self_calibrated_error']:.1%} "
            f"cross-cal {res.get('sim_cross_calibrated_error', float('nan')):.1%}  "
            f"({time.monotonic() - t:.0f} s)",
            flush=True,
        )
        return res

    results: dict[str, dict] = {}
    reps: dict[str, list[dict]] = {k: [] for k in runs_spec}
    order = list(runs_spec)
    for rep in range(max(1, args.repeat)):
        names = order if rep % 2 == 0 else order[::-1]
        for name in names:
            res = _one_run(name, runs_spec[name], rep)
            reps[name].append(res)
    for name, lst in reps.items():
        lst.sort(key=lambda r: r["output_tok_s"])
        med = dict(lst[(len(lst) - 1) // 2])  # lower median: conservative
        med["repeats_output_tok_s"] = [r["output_tok_s"] for r in lst]
        results[name] = med

    peer = None
    if not args.quick and args.hf_requests > 0:
        peer = hf_generate_peer(
            model_dir, trace[: args.hf_requests], args.hf_batch, threads=args.hf_threads
        )
        print(
            f"transformers generate: {peer['output_tok_s']:.1f} out tok/s "
            f"({peer['requests']} requests)",
            flush=True,
        )
    projection = None
    if not args.quick and not args.no_projection:
        projection = project_gpu(
            [(r.input_len, r.output_len, r.output_len) for r in make_trace(1000, seed=args.seed)]
        )
        print(
            f"4xL20 projection (roofline costs): tdpipe/interleaved "
            f"{projection['tdpipe_over_interleaved']:.2f}x; paper reports up to "
            f"{projection['paper']['tdpipe_over_pipeline_parallel_max']}x over PP",
            flush=True,
        )

    ratios = {}
    if "interleaved" in results:
        b = results["interleaved"]["output_tok_s"]
        ratios = {k: v["output_tok_s"] / b for k, v in results.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    png = plot_kv_timeline(
        {k: v for k, v in results.items()}, args.out / f"serve_kv_usage{args.tag}.png"
    )
    summary_keys = (
        "req_s",
        "input_tok_s",
        "output_tok_s",
        "total_tok_s",
        "wall_s",
        "latency_p50_s",
        "latency_p99_s",
        "preemptions",
        "kv_peak_blocks",
        "kv_blocks",
        "kv_allocated_bytes",
        "micro_batches",
        "engine_decide_s",
        "mode_switches",
        "stages",
        "sim",
        "sim_error",
        "sim_isolated_profile_error",
        "cost_table",
        "profile_s",
        "sim_self_calibrated",
        "sim_self_calibrated_error",
        "sim_cross_calibrated",
        "sim_cross_calibrated_error",
        "predictor",
        "outputs_digest",
        "setup_s",
        "finish_reasons",
        "repeats_output_tok_s",
    )
    out = {
        "benchmark": "serve_throughput",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": _versions(),
        "machine": {**machine, "loadavg_end": os.getloadavg()},
        "note": (
            "CPU shared with other jobs (load average above the 2 usable cores), so "
            "absolute numbers and ratios are noisy; every run uses the same trace: prompt "
            f"lengths x{in_scale}, output lengths x{out_scale} of the ShareGPT-like trace "
            "(see trace_scales) to fit the time budget; outputs forced to the trace "
            "lengths (EOS ignored); "
            "random weights (no hub access), byte-level tokenizer."
        ),
        "model": {
            "dir": str(model_dir),
            "params": mcfg.n_params,
            "layers": mcfg.num_hidden_layers,
            "hidden": mcfg.hidden_size,
            "heads": mcfg.num_attention_heads,
            "kv_heads": mcfg.num_key_value_heads,
            "vocab": mcfg.vocab_size,
        },
        "args": {k: str(v) for k, v in vars(args).items()},
        "trace_scales": {"input": in_scale, "output": out_scale},
        "trace": trace_stats(trace),
        "trace_unscaled": trace_stats(full_trace),
        "kv_budget_bytes": kv_budget,
        "cost_table_one_process": costs_isolated.__dict__,
        "learned_predictor_accuracy": test_acc,
        "decode_step_profile": step_profile,
        "runs": {k: {kk: v.get(kk) for kk in summary_keys} for k, v in results.items()},
        "output_tok_s_over_interleaved": ratios,
        "target": "tdpipe >= 1.3x interleaved output tok/s",
        "transformers_generate_peer": peer,
        "sim_error_by_run": {k: v["sim_error"] for k, v in results.items()},
        "sim_max_error": {
            "profiled_in_situ_startup_table": max(
                (v["sim_error"] for v in results.values()), default=None
            ),
            "profiled_one_process_table": max(
                (v["sim_isolated_profile_error"] for v in results.values()), default=None
            ),
            "self_calibrated": max(
                (v["sim_self_calibrated_error"] for v in results.values()), default=None
            ),
            "cross_calibrated_on_interleaved": max(
                (
                    v["sim_cross_calibrated_error"]
                    for v in results.values()
                    if "sim_cross_calibrated_error" in v
                ),
                default=None,
            ),
        },
        "calibrated_pipeline_cost_table": calib["pipeline"].__dict__
        if "pipeline" in calib
        else None,
        "gpu_projection": projection,
        "kv_usage_plot": str(png),
    }
    path = args.out / f"serve_throughput{args.tag}.json"
    atomic_write_text(path, json.dumps(out, indent=1, default=str))
    print(f"wrote {path} and {png}")
    for k, r in ratios.items():
        print(f"  {k:20s} {r:.2f}x interleaved")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
