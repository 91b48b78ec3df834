"""OpenAI-compatible HTTP API over the engine (FastAPI; run with uvicorn).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(both with ``stream: true`` as server-sent events ending in ``data: [DONE]``),
``GET /health`` (200 ok / 503 with the reason), ``GET /metrics`` (Prometheus,
:mod:`convergent.serve.metrics`), ``GET /load`` (what the dispatcher routes by) and
``GET /stats``. A request naming another model gets 404 (as vLLM answers). Requests are
validated by :mod:`convergent.serve.protocol` (400 naming the field); text is tokenized
with the checkpoint's own tokenizer and chat template (:mod:`convergent.serve.tokenizer`). With an API key set, every ``/v1`` request needs
``Authorization: Bearer <key>`` (401 otherwise).

Failures: a request whose engine request ends with ``finish_reason="error"`` (a stage died,
the server is shutting down, ``serve.request_timeout_s`` passed) gets a 503 with the reason,
or, when streaming, an ``error`` event before ``[DONE]``; while the engine is unhealthy
or draining new requests get 503 at once.

This module holds the app and its routes; the input side (prompts to engine requests) is
:mod:`convergent.serve.api_requests`, the output side (tokens to responses and
server-sent events) :mod:`convergent.serve.api_stream`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import asdict
from typing import Any

from fastapi import Request as HTTPRequest  # module level: FastAPI resolves annotations

from convergent.serve.api_requests import build_requests, error_response
from convergent.serve.api_stream import TokenChannel, events, final_response, sse_chunks
from convergent.serve.engine import Engine
from convergent.serve.messages import TokenEvent
from convergent.serve.metrics import ServeMetrics
from convergent.serve.predictor import LengthPredictor
from convergent.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Health,
    ModelCard,
    ModelList,
    RequestError,
    parse_request,
)

__all__ = ["create_app"]


def create_app(
    engine: Engine,
    model_name: str = "convergent-llama",
    api_key: str = "",
    predictor: LengthPredictor | None = None,
    tokenizer: Any = "auto",
):
    """Build the FastAPI app; the engine must be started (:meth:`Engine.start`).

    ``tokenizer="auto"`` loads the checkpoint's (:func:`~convergent.serve.tokenizer.load_tokenizer`).
    """
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    if tokenizer == "auto":
        from convergent.serve.tokenizer import load_tokenizer

        tokenizer, _ = load_tokenizer(engine.model_dir, engine.vocab_size)
    tok = tokenizer
    app = FastAPI(title="convergent serve", version="0.2")
    streams: dict[int, TokenChannel] = {}
    counters = {"requests": 0, "completed": 0, "tokens": 0}
    metrics = ServeMetrics(lambda: engine.queue_length, lambda: engine.kv_usage().fraction)
    app.state.metrics = metrics
    app.state.tokenizer = tok

    def on_token(ev: TokenEvent) -> None:
        s = streams.get(ev.rid)
        if s is None:
            return
        if ev.token >= 0:
            now = time.monotonic()
            last = s.last.get(ev.rid)
            if last is None:
                metrics.ttft.observe(now - s.arrival)
            else:
                metrics.itl.observe(now - last)
            s.last[ev.rid] = now
            metrics.output_tokens.inc()
        s.push(ev)

    engine.add_token_listener(on_token)

    def _auth(request: HTTPRequest):
        if not api_key:
            return None
        if request.headers.get("authorization", "") != f"Bearer {api_key}":
            return error_response(
                401, "invalid or missing API key", "invalid_api_key", "authentication_error"
            )
        return None

    def _unavailable():
        if engine.accepting:
            return None
        metrics.requests.labels(status="rejected").inc()
        if engine.error is not None:
            msg, code = f"the engine stopped: {engine.error}", "engine_dead"
        elif engine.shutting_down:
            msg, code = "the server is shutting down", "shutting_down"
        else:
            msg, code = (
                f"the engine is restarting after a failure: {engine.failure}",
                "engine_restarting",
            )
        return error_response(503, msg, code, "server_error")

    def _finish_metrics(outs, cancelled: bool) -> None:
        if cancelled:
            status = "aborted"
        elif any(o.finish_reason == "error" for o in outs):
            status = "error"
        else:
            status = "ok"
        metrics.requests.labels(status=status).inc()
        counters["completed"] += 1
        counters["tokens"] += sum(len(o.tokens) for o in outs)

    async def _handle(request: HTTPRequest, chat: bool):
        t_arrival = time.monotonic()
        err = _auth(request) or _unavailable()
        if err is not None:
            return err
        try:
            body = parse_request(
                await request.body(), ChatCompletionRequest if chat else CompletionRequest
            )
            if body.model is not None and body.model != model_name:
                metrics.requests.labels(status="rejected").inc()
                return error_response(
                    404,
                    f"The model '{body.model}' does not exist (this server has '{model_name}')",
                    "model_not_found",
                    "NotFoundError",
                    param="model",
                )
            reqs, outs = build_requests(engine, body, chat, tok, predictor)
        except RequestError as e:
            metrics.requests.labels(status="rejected").inc()
            return error_response(400, e.message, e.code, param=e.param)
        except Exception as e:  # noqa: BLE001 - e.g. InputError from the engine
            metrics.requests.labels(status="rejected").inc()
            return error_response(400, str(e), "invalid_request")
        stream = TokenChannel(asyncio.get_running_loop(), t_arrival)
        for r in reqs:
            streams[r.rid] = stream
        counters["requests"] += 1
        for r in reqs:
            engine.add_request(r)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())

        def cleanup(cancelled: bool):
            for r in reqs:
                streams.pop(r.rid, None)
                if not r.finished:
                    engine.abort(r.rid)
            _finish_metrics(outs, cancelled)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def sse_body():
                cancelled = True
                try:
                    async for chunk in sse_chunks(
                        engine, stream, reqs, outs, chat, rid, created, model_name, include_usage
                    ):
                        yield chunk
                    cancelled = False
                finally:
                    cleanup(cancelled)

            return StreamingResponse(sse_body(), media_type="text/event-stream")

        cancelled = True
        try:
            async for _o, _d in events(engine, stream, reqs, outs):
                pass
            cancelled = False
        finally:
            cleanup(cancelled)
        return final_response(reqs, outs, chat, rid, created, model_name)

    @app.get("/health")
    async def health():
        if engine.accepting and not engine.stalled:
            return Health(status="ok", restarts=engine.restarts).model_dump(exclude_none=True)
        if engine.shutting_down and engine.error is None:
            h = Health(status="shutting_down", restarts=engine.restarts)
        else:
            why = str(engine.error or engine.failure or "the engine loop is stalled")
            h = Health(status="unhealthy", reason=why, restarts=engine.restarts)
        return JSONResponse(h.model_dump(exclude_none=True), status_code=503)

    @app.get("/metrics")
    async def prom():
        data, ctype = metrics.render()
        return Response(data, media_type=ctype)

    @app.get("/load")
    async def load():
        return asdict(engine.load())

    @app.get("/v1/models")
    async def models(request: HTTPRequest):
        err = _auth(request)
        if err is not None:
            return err
        return ModelList(
            data=[ModelCard(id=model_name, max_model_len=engine.context_limit)]
        ).model_dump()

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await _handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await _handle(request, chat=True)

    @app.get("/stats")
    async def stats():
        return {**counters, **asdict(engine.serving_stats())}

    return app
