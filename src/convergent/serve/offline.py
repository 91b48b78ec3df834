"""Offline runs: a trace through the engine, throughput metrics, a KV-usage plot, and a
random Hugging Face-format checkpoint for when no real weights are available."""

from __future__ import annotations

import time
from pathlib import Path

from convergent.serve.config import ServeConfig
from convergent.serve.workload import TraceRequest

__all__ = ["ensure_random_model", "run_trace", "plot_kv_timeline", "throughput"]


def ensure_random_model(path: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Create (once) a random Llama checkpoint in Hugging Face layout at ``path``.

    ``size``: ``tiny`` (~0.1M params, 4 layers) or ``30m`` (~30M params: hidden 512,
    10 layers, GQA 8/2, vocab 2048). Vocabulary >= 258 so the byte tokenizer fits.
    """
    import torch

    from convergent.models.llama import LlamaConfig, LlamaForCausalLM, save_pretrained

    p = Path(path)
    if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        return p
    if size == "tiny":
        cfg = LlamaConfig.tiny(initializer_range=0.1)
    elif size == "30m":
        cfg = LlamaConfig.small_30m(num_hidden_layers=10, vocab_size=2048, initializer_range=0.05)
    else:
        raise ValueError(f"unknown size {size!r} (tiny, 30m)")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.reset_parameters(seed=seed)
    return save_pretrained(model, p)


def throughput(reqs, wall_s: float) -> dict:
    """Requests/s and input/output/total tokens/s of finished requests over ``wall_s``."""
    n_in = sum(len(r.prompt) for r in reqs)
    n_out = sum(len(r.output) for r in reqs)
    return {
        "requests": len(reqs),
        "input_tokens": n_in,
        "output_tokens": n_out,
        "req_s": len(reqs) / wall_s,
        "input_tok_s": n_in / wall_s,
        "output_tok_s": n_out / wall_s,
        "total_tok_s": (n_in + n_out) / wall_s,
    }


def run_trace(
    model_dir: str | Path,
    cfg: ServeConfig,
    trace: list[TraceRequest],
    predictor=None,
    costs=None,
    progress: bool = False,
    profile: bool = False,
) -> dict:
    """Run every trace request (output length forced to the trace's, EOS ignored).

    Returns throughput, per-stage busy fraction and bubble time, KV peak, latency
    percentiles and the KV timeline ``[(t_s, used_blocks)]``. ``profile``: profile the
    cost table in situ at start-up even if the scheduler does not need it.
    """
    import numpy as np

    from convergent.serve.engine import Engine
    from convergent.serve.tokenizer import ByteTokenizer

    t_setup = time.monotonic()
    eng = Engine(model_dir, cfg, costs=costs, ignore_eos=True, profile=profile)
    setup_s = time.monotonic() - t_setup
    tok = ByteTokenizer(eng.vocab_size)
    try:
        reqs = []
        for tr in trace:
            ids = tok.encode(tr.prompt)
            pred = predictor.predict(tr.prompt, tr.output_len) if predictor is not None else None
            r = eng.make_request(ids, tr.output_len, pred)
            reqs.append(r)
        t0 = time.monotonic()
        for r in reqs:
            r.arrival = t0
            eng.add_request(r)
        if progress:
            from rich.progress import Progress

            with Progress(transient=True) as bar:
                task = bar.add_task(f"{cfg.scheduler.kind}", total=len(reqs))
                done = eng.run(progress=lambda n: bar.advance(task, n))
        else:
            done = eng.run()
        wall = eng.stats.t_end - t0
        summary = eng.summary()
    finally:
        eng.close()
    lat = np.array([(r.finish_time or t0) - t0 for r in done])
    out = {
        "scheduler": cfg.scheduler.kind,
        "chunked_prefill": cfg.scheduler.chunked_prefill,
        "setup_s": setup_s,
        "profile_s": eng.profile_s,
        **throughput(done, wall),
        "latency_p50_s": float(np.percentile(lat, 50)),
        "latency_p99_s": float(np.percentile(lat, 99)),
        "finish_reasons": {
            k: sum(1 for r in done if r.finish_reason == k) for k in {r.finish_reason for r in done}
        },
        **summary,
        "wall_s": wall,
        "kv_timeline": [(t - t0, u) for t, u in eng.stats.kv_timeline],
        "outputs_digest": _digest([r.output for r in done]),
        "_outputs": [list(r.output) for r in done],  # token ids by request (not summarised)
        "_batch_log": eng.stats.batch_log,  # not JSON: for simulator calibration
    }
    if eng.costs is not None:
        out["cost_table"] = eng.costs.__dict__
    return out


def _digest(outputs: list[list[int]]) -> str:
    import hashlib

    h = hashlib.sha256()
    for o in outputs:
        h.update((",".join(map(str, o)) + ";").encode())
    return h.hexdigest()[:16]


def plot_kv_timeline(
    runs: dict[str, dict], path: str | Path, num_blocks: int | None = None
) -> Path:
    """One line per run: KV blocks in use over time (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, r in runs.items():
        tl = r.get("kv_timeline") or []
        if tl:
            ax.plot([t for t, _ in tl], [u for _, u in tl], label=name, lw=1)
        num_blocks = num_blocks or r.get("kv_blocks")
    if num_blocks:
        ax.axhline(num_blocks, color="k", ls="--", lw=0.8, label="budget")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("KV blocks in use")
    ax.legend(fontsize=7)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name("." + p.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(p)
    return p
