"""`convergent serve`, `convergent generate`, `convergent bench-serve`: thin CLI over
:mod:`convergent.serve` (heavy imports happen inside the commands)."""

from __future__ import annotations

from pathlib import Path

import typer

from convergent.cli.common import CONFIG_ARG, SET_OPT, config_from_cli
from convergent.core.fsutil import dumps_json

MODEL_OPT = typer.Option(
    None,
    "--model",
    "-m",
    help="Hugging Face Llama checkpoint dir (config.json + safetensors). "
    "Default: serve.model, else a tiny random Llama created under the run directory.",
)
QUANT_OPT = typer.Option(
    None,
    "--quantize",
    help="INT8 inference: int8 (weight-only, per-channel) or int8-dynamic (torch, CPU fp32); "
    "sets serve.engine.quantize.",
)


def _with_quant(sets: list[str] | None, quantize: str | None) -> list[str] | None:
    """``--quantize X`` as ``--set serve.engine.quantize=X`` (so dispatched instances get it
    too)."""
    return [*(sets or []), f"serve.engine.quantize={quantize}"] if quantize else sets


def _model_dir(cfg, model: Path | None, size: str = "tiny") -> Path:
    from convergent.core.errors import InputError
    from convergent.serve.engine_setup import check_weights
    from convergent.serve.offline import ensure_random_model

    path = model or (Path(cfg.serve.model) if cfg.serve.model else None)
    if path is None:
        return ensure_random_model(
            Path(cfg.run.root) / (cfg.run.name or "serve") / f"serve-model-{size}", size
        )
    if not (path / "config.json").is_file():
        raise InputError(
            f"{path}: not a Hugging Face checkpoint directory (config.json missing)",
            hint="pass --model DIR with config.json and *.safetensors",
        )
    check_weights(path)  # before any instance or stage starts
    return path


def _predictor(cfg, scale: float = 1.0):
    from convergent.serve.predictor import make_predictor

    sc = cfg.serve.scheduler
    return make_predictor(sc.predictor, sc.predictor_path, length_scale=scale)


def _serve(
    config: Path | None = CONFIG_ARG,
    sets: list[str] | None = SET_OPT,
    model: Path | None = MODEL_OPT,
    quantize: str | None = QUANT_OPT,
    host: str | None = typer.Option(
        None, help="Bind address (default serve.http.host, 127.0.0.1)."
    ),
    port: int | None = typer.Option(
        None, min=1, max=65535, help="Port (default serve.http.port)."
    ),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="CONVERGENT_API_KEY", help="Require this bearer key."
    ),
    instances: int | None = typer.Option(
        None,
        "--instances",
        min=1,
        max=64,
        help="Instances behind one dispatcher (serve.dispatch.instances; given, even 1, a "
        "dispatcher runs).",
    ),
) -> None:
    """OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, streaming,
    /health, /metrics); with serve.dispatch.instances > 1 (or --instances), N instances
    behind a load-aware dispatcher."""
    sets = _with_quant(sets, quantize)
    cfg = config_from_cli(config, sets)
    from convergent.cluster.resources import check_port_free

    sc = _with_options(cfg.serve, host, port, api_key, instances)
    check_port_free(sc.http.host, sc.http.port)  # before loading anything
    mdir = _model_dir(cfg, model)
    d = sc.dispatch
    if d.instances > 1 or d.instance_urls or instances is not None:  # dispatched
        from convergent.serve.dispatch import run_dispatcher

        run_dispatcher(mdir, sc, config, sets)
        return
    from convergent.serve.server import serve_forever

    s = sc.scheduler
    pred = _predictor(cfg) if s.kind == "tdpipe" and s.predictor != "oracle" else None
    serve_forever(mdir, sc, pred)


def _with_options(sc, host: str | None, port: int | None, key: str | None, instances: int | None):
    """The ``serve`` section with the command-line options in their places (``--host``,
    ``--port``, ``--api-key`` in ``http``; ``--instances`` in ``dispatch``)."""
    given = {"host": host, "port": port, "api_key": key}
    http = sc.http.model_copy(update={k: v for k, v in given.items() if v is not None})
    update = {"http": http}
    if instances is not None:
        update["dispatch"] = sc.dispatch.model_copy(update={"instances": instances})
    return sc.model_copy(update=update)


def _generate(
    prompt: str = typer.Argument(..., help="Prompt text (byte-level tokenizer)."),
    config: Path | None = typer.Option(None, "--config", "-c", help="YAML config file."),
    sets: list[str] | None = SET_OPT,
    model: Path | None = MODEL_OPT,
    quantize: str | None = QUANT_OPT,
    max_tokens: int = typer.Option(32, "--max-tokens", "-n", min=1, help="Tokens to generate."),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy."),
    ids: bool = typer.Option(False, "--ids", help="Print token ids instead of text."),
) -> None:
    """Generate a completion for one prompt through the pipeline."""
    sets = _with_quant(sets, quantize)
    cfg = config_from_cli(config, sets)
    from convergent.core.errors import InputError
    from convergent.models.llama import read_config
    from convergent.serve.engine import Engine
    from convergent.serve.tokenizer import load_tokenizer

    mdir = _model_dir(cfg, model)
    if max_tokens < 1:
        raise InputError("--max-tokens must be at least 1")
    tok, note = load_tokenizer(mdir, read_config(mdir).vocab_size)
    if tok is None:
        raise InputError(note.removeprefix("tokenizer: "))
    sched = cfg.serve.scheduler.model_copy(update={"profile_costs": False})
    with Engine(mdir, cfg.serve.model_copy(update={"scheduler": sched})) as eng:
        prompt_ids = tok.encode(prompt)
        why = eng.context_error(len(prompt_ids), max_tokens)
        if why is not None:
            raise InputError(why, hint="shorten the prompt or lower --max-tokens")
        req = eng.add_request(eng.make_request(prompt_ids, max_tokens, temperature=temperature))
        eng.run()
    typer.echo(dumps_json(req.output) if ids else tok.decode(req.output))


def _bench(
    config: Path | None = CONFIG_ARG,
    sets: list[str] | None = SET_OPT,
    model: Path | None = MODEL_OPT,
    quantize: str | None = QUANT_OPT,
    requests: int = typer.Option(64, "--requests", "-r", min=1, help="Trace requests."),
    scale: float = typer.Option(
        0.125, help="Scale trace lengths (1.0 = ShareGPT-like; smaller for laptops)."
    ),
    seed: int = typer.Option(0, help="Trace seed."),
    out: Path = typer.Option(Path("bench-serve"), "--out", help="Output dir (JSON + PNG)."),
) -> None:
    """Offline throughput on a seeded ShareGPT-like trace: req/s, tok/s, bubbles, KV plot."""
    sets = _with_quant(sets, quantize)
    cfg = config_from_cli(config, sets)
    from convergent.core.errors import InputError
    from convergent.core.fsutil import atomic_write_text
    from convergent.serve.offline import plot_kv_timeline, run_trace
    from convergent.serve.workload import make_trace, scale_trace, trace_stats

    if requests < 1 or scale <= 0:
        raise InputError("--requests must be >= 1 and --scale > 0")
    mdir = _model_dir(cfg, model)
    trace = make_trace(requests, seed=seed)
    if scale != 1.0:
        trace = scale_trace(trace, scale)
    sc = cfg.serve
    pred = _predictor(cfg, scale)
    res = run_trace(mdir, sc, trace, predictor=pred, progress=True)
    res = {k: v for k, v in res.items() if not k.startswith("_")}
    res["trace"] = trace_stats(trace)
    res["predictor"] = sc.scheduler.predictor
    out.mkdir(parents=True, exist_ok=True)
    png = plot_kv_timeline({sc.scheduler.kind: res}, out / "kv_usage.png")
    atomic_write_text(out / "bench_serve.json", dumps_json(res, indent=1, default=str))
    typer.echo(
        f"{sc.scheduler.kind}: {res['requests']} requests in {res['wall_s']:.1f} s | "
        f"{res['req_s']:.2f} req/s | input {res['input_tok_s']:.0f} tok/s | "
        f"output {res['output_tok_s']:.0f} tok/s | total {res['total_tok_s']:.0f} tok/s"
    )
    for st in res["stages"]:
        typer.echo(
            f"  stage {st['stage']}: busy {st['busy_fraction']:.1%}, "
            f"bubble {st['bubble_s']:.1f} s"
        )
    typer.echo(
        f"  KV peak {res['kv_peak_blocks']}/{res['kv_blocks']} blocks; "
        f"plot {png}; json {out / 'bench_serve.json'}"
    )


def register(app: typer.Typer) -> None:
    """Add `serve`, `generate` and `bench-serve` to the root app."""
    app.command("serve")(_serve)
    app.command("generate")(_generate)
    app.command("bench-serve")(_bench)

