"""OpenAI-compatible HTTP API over the engine (FastAPI; run with uvicorn).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(both with ``stream: true`` as server-sent events ending in ``data: [DONE]``),
``GET /health`` (200 ok / 503 with the reason), ``GET /metrics`` (Prometheus,
:mod:`convergent.serve.metrics`), ``GET /load`` (what the dispatcher routes by) and
``GET /stats``. A request naming another model gets 404 (as vLLM answers). Requests are
validated by :mod:`convergent.serve.protocol` (400 naming the field); text is tokenized
with the checkpoint's own tokenizer and chat template (:mod:`convergent.serve.tokenizer`)
in a worker thread, so a long prompt does not hold up the event loop, and only once the
body is known to be within ``serve.http.max_request_bytes`` (413 otherwise,
:mod:`convergent.serve.http_body`). With an API key set, every ``/v1`` request needs
``Authorization: Bearer <key>`` (401 otherwise).

Failures: a request whose engine request ends with ``finish_reason="error"`` (a stage died,
the server is shutting down, ``serve.http.request_timeout_s`` passed) gets a 503 with the reason,
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
from fastapi.responses import JSONResponse, Response, StreamingResponse

from convergent.serve.api_requests import build_requests, error_response
from convergent.serve.api_stream import TokenChannel, events, final_response, sse_chunks
from convergent.serve.config import HttpConfig
from convergent.serve.engine import Engine
from convergent.serve.http_body import BodyTooLarge, read_body, too_large
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


class _Api:
    """What the routes share: the engine, the open token channels, the counters and metrics."""

    def __init__(
        self,
        engine: Engine,
        http: HttpConfig,
        model_name: str,
        predictor: LengthPredictor | None,
        tok: Any,
    ) -> None:
        self.engine = engine
        self.http = http
        self.model_name = model_name
        self.api_key = http.api_key
        self.predictor = predictor
        self.tok = tok
        self.streams: dict[int, TokenChannel] = {}
        self.counters = {"requests": 0, "completed": 0, "tokens": 0}
        self.metrics = ServeMetrics(lambda: engine.queue_length, lambda: engine.kv_usage().fraction)

    def on_token(self, ev: TokenEvent) -> None:
        """Engine-thread listener: time the token (TTFT / ITL) and hand it to its channel."""
        s = self.streams.get(ev.rid)
        if s is None:
            return
        if ev.token >= 0:
            now = time.monotonic()
            last = s.last.get(ev.rid)
            if last is None:
                self.metrics.ttft.observe(now - s.arrival)
            else:
                self.metrics.itl.observe(now - last)
            s.last[ev.rid] = now
            self.metrics.output_tokens.inc()
        s.push(ev)

    def auth(self, request: HTTPRequest):
        """The 401 of a request without the API key, or ``None``."""
        if not self.api_key:
            return None
        if request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            return error_response(
                401, "invalid or missing API key", "invalid_api_key", "authentication_error"
            )
        return None

    def unavailable(self):
        """The 503 while the engine takes no requests (dead, shutting down, restarting), or ``None``."""
        engine = self.engine
        if engine.accepting:
            return None
        self.metrics.requests.labels(status="rejected").inc()
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

    def rejected(self, response):
        """Count a rejected request and pass its error response on."""
        self.metrics.requests.labels(status="rejected").inc()
        return response

    async def parse(self, request: HTTPRequest, chat: bool):
        """The validated body and its engine requests and choices, or the 413 / 400 / 404.
        The body is read under the size limit first; parsing and tokenizing run in a
        worker thread."""
        limit = self.http.max_request_bytes
        try:
            raw = await read_body(request, limit)
            return await asyncio.to_thread(self.build, raw, chat)
        except BodyTooLarge:
            return self.rejected(too_large(limit, "messages" if chat else "prompt"))
        except RequestError as e:
            return self.rejected(error_response(400, e.message, e.code, param=e.param))
        except Exception as e:  # noqa: BLE001 - e.g. InputError from the engine
            return self.rejected(error_response(400, str(e), "invalid_request"))

    def build(self, raw: bytes, chat: bool):
        """(Worker thread.) The validated body and its engine requests and choices, or the
        404 of another model; :class:`RequestError` for a bad request."""
        body = parse_request(raw, ChatCompletionRequest if chat else CompletionRequest)
        if body.model is not None and body.model != self.model_name:
            return self.rejected(
                error_response(
                    404,
                    f"The model '{body.model}' does not exist (this server has '{self.model_name}')",
                    "model_not_found",
                    "NotFoundError",
                    param="model",
                )
            )
        reqs, outs = build_requests(
            self.engine, body, chat, self.tok, self.predictor, self.http.default_max_tokens
        )
        return body, reqs, outs

    def start(self, reqs: list, t_arrival: float) -> TokenChannel:
        """Open the token channel of a request's choices and add them to the engine."""
        stream = TokenChannel(asyncio.get_running_loop(), t_arrival)
        for r in reqs:
            self.streams[r.rid] = stream
        self.counters["requests"] += 1
        for r in reqs:
            self.engine.add_request(r)
        return stream

    def finish(self, reqs: list, outs: list, cancelled: bool) -> None:
        """Close a request: drop its channel, abort unfinished choices, count the outcome."""
        for r in reqs:
            self.streams.pop(r.rid, None)
            if not r.finished:
                self.engine.abort(r.rid)
        if cancelled:
            status = "aborted"
        elif any(o.finish_reason == "error" for o in outs):
            status = "error"
        else:
            status = "ok"
        self.metrics.requests.labels(status=status).inc()
        self.counters["completed"] += 1
        self.counters["tokens"] += sum(len(o.tokens) for o in outs)

    async def handle(self, request: HTTPRequest, chat: bool):
        """A completion or chat completion request, streamed or whole."""
        t_arrival = time.monotonic()
        err = self.auth(request) or self.unavailable()
        if err is not None:
            return err
        parsed = await self.parse(request, chat)
        if not isinstance(parsed, tuple):
            return parsed
        body, reqs, outs = parsed
        stream = self.start(reqs, t_arrival)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = sse_chunks(
                self.engine,
                stream,
                reqs,
                outs,
                chat=chat,
                rid=rid,
                created=created,
                model_name=self.model_name,
                include_usage=include_usage,
                timeout_s=self.http.request_timeout_s,
            )
            return StreamingResponse(
                self.sse_body(chunks, reqs, outs), media_type="text/event-stream"
            )
        cancelled = True
        try:
            timeout_s = self.http.request_timeout_s
            async for _o, _d in events(self.engine, stream, reqs, outs, timeout_s):
                pass
            cancelled = False
        finally:
            self.finish(reqs, outs, cancelled)
        return final_response(reqs, outs, chat, rid, created, self.model_name)

    async def sse_body(self, chunks, reqs: list, outs: list):
        """Relay the server-sent events, closing the request however the stream ends."""
        cancelled = True
        try:
            async for chunk in chunks:
                yield chunk
            cancelled = False
        finally:
            self.finish(reqs, outs, cancelled)


def _add_status_routes(app, api: _Api) -> None:
    """``GET /health``, ``/metrics``, ``/load`` and ``/stats``."""
    engine = api.engine

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
        data, ctype = api.metrics.render()
        return Response(data, media_type=ctype)

    @app.get("/load")
    async def load():
        return asdict(engine.load())

    @app.get("/stats")
    async def stats():
        return {**api.counters, **asdict(engine.serving_stats())}


def _add_openai_routes(app, api: _Api) -> None:
    """``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions``."""

    @app.get("/v1/models")
    async def models(request: HTTPRequest):
        err = api.auth(request)
        if err is not None:
            return err
        return ModelList(
            data=[ModelCard(id=api.model_name, max_model_len=api.engine.context_limit)]
        ).model_dump()

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await api.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await api.handle(request, chat=True)


def create_app(
    engine: Engine,
    http: HttpConfig | None = None,
    *,
    model_name: str = "convergent-llama",
    predictor: LengthPredictor | None = None,
    tokenizer: Any = "auto",
):
    """Build the FastAPI app over a started engine (:meth:`Engine.start`) with the
    ``serve.http`` settings (API key, request limits; default: the engine's own).

    ``tokenizer="auto"`` loads the checkpoint's (:func:`~convergent.serve.tokenizer.load_tokenizer`).
    """
    from fastapi import FastAPI

    if tokenizer == "auto":
        from convergent.serve.tokenizer import load_tokenizer

        tokenizer, _ = load_tokenizer(engine.model_dir, engine.vocab_size)
    api = _Api(engine, http or engine.cfg.http, model_name, predictor, tokenizer)
    app = FastAPI(title="convergent serve", version="0.2")
    app.state.metrics = api.metrics
    app.state.tokenizer = tokenizer
    engine.add_token_listener(api.on_token)
    _add_status_routes(app, api)
    _add_openai_routes(app, api)
    return app
