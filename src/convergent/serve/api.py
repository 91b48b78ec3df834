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
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import Request as HTTPRequest  # module level: FastAPI resolves annotations

from convergent.serve.engine import Engine
from convergent.serve.metrics import ServeMetrics
from convergent.serve.output import ChoiceOutput
from convergent.serve.predictor import LengthPredictor
from convergent.serve.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Health,
    ModelCard,
    ModelList,
    RequestError,
    Usage,
    parse_request,
)
from convergent.serve.scheduler import Request

__all__ = ["create_app"]


def _error(status: int, message: str, code: str, etype: str = "invalid_request_error", param=None):
    from fastapi.responses import JSONResponse

    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": etype, "param": param, "code": code}},
    )


class _Stream:
    """Per-HTTP-request channel from the engine thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, arrival: float) -> None:
        self.loop = loop
        self.q: asyncio.Queue = asyncio.Queue()
        self.arrival = arrival
        self.last: dict[int, float] = {}

    def push(self, rid: int, token: int, finished: bool, reason: str | None) -> None:
        self.loop.call_soon_threadsafe(self.q.put_nowait, (rid, token, finished, reason))


def _sse(obj) -> str:
    data = (
        obj.model_dump_json(exclude_none=True)
        if hasattr(obj, "model_dump_json")
        else json.dumps(obj)
    )
    return f"data: {data}\n\n"


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

        tokenizer, _ = load_tokenizer(engine.model_dir, engine.mcfg.vocab_size)
    tok = tokenizer
    app = FastAPI(title="convergent serve", version="0.2")
    streams: dict[int, _Stream] = {}
    counters = {"requests": 0, "completed": 0, "tokens": 0}
    vocab = engine.mcfg.vocab_size
    metrics = ServeMetrics(
        lambda: engine.queue_length,
        lambda: engine.bm.num_used / max(1, engine.bm.num_blocks),
    )
    app.state.metrics = metrics
    app.state.tokenizer = tok

    def on_token(req: Request, token: int, finished: bool) -> None:
        s = streams.get(req.rid)
        if s is None:
            return
        if token >= 0:
            now = time.monotonic()
            last = s.last.get(req.rid)
            if last is None:
                metrics.ttft.observe(now - s.arrival)
            else:
                metrics.itl.observe(now - last)
            s.last[req.rid] = now
            metrics.output_tokens.inc()
        s.push(req.rid, token, finished, req.finish_reason)

    engine.on_token = on_token

    def _auth(request: HTTPRequest):
        if not api_key:
            return None
        if request.headers.get("authorization", "") != f"Bearer {api_key}":
            return _error(
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
        return _error(503, msg, code, "server_error")

    def _prompts(body, chat: bool) -> list[list[int]]:
        if chat:
            if tok is None:
                raise RequestError(
                    "messages: this checkpoint has no tokenizer (token-id prompts only)", "messages"
                )
            if not tok.has_chat_template:
                raise RequestError(
                    "messages: this checkpoint's tokenizer has no chat template", "messages"
                )
            try:
                text, has_bos = tok.render_chat([m.as_template_dict() for m in body.messages])
            except Exception as exc:
                raise RequestError(
                    f"messages: the chat template failed: {exc}", "messages"
                ) from None
            return [tok.encode(text, bos=not has_bos)]
        p = body.prompt
        items = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        out = []
        for it in items:
            if isinstance(it, str):
                if tok is None:
                    raise RequestError(
                        "prompt: this checkpoint has no tokenizer; send token ids (a list of ints)",
                        "prompt",
                    )
                out.append(tok.encode(it))
            else:
                bad = [i for i in it if i >= vocab]
                if bad:
                    raise RequestError(f"prompt: token id {bad[0]} >= vocab_size {vocab}", "prompt")
                out.append(list(it))
        return out

    def _make(body, chat: bool) -> tuple[list[Request], list[ChoiceOutput]]:
        prompts = _prompts(body, chat)
        mt = getattr(body, "max_completion_tokens", None) or body.max_tokens
        limit = engine.context_limit
        bad = [i for i in body.stop_token_ids or [] if i >= vocab]
        if bad:
            raise RequestError(f"stop_token_ids: {bad[0]} >= vocab_size {vocab}", "stop_token_ids")
        if (body.stop_strings or body.logprobs) and tok is None:
            param = "stop" if body.stop_strings else "logprobs"
            raise RequestError(f"{param}: needs a tokenizer, and this checkpoint has none", param)
        if chat:
            lp = (body.top_logprobs or 0) if body.logprobs else -1
        else:
            lp = -1 if body.logprobs is None else body.logprobs
        temp = body.temperature or 0.0
        top_k = body.top_k if body.top_k and body.top_k > 0 else 0
        eos = [] if body.ignore_eos else list(tok.eos_ids if tok is not None else [])
        reqs, outs = [], []
        for p_ids in prompts:
            max_tokens = (
                mt
                if mt is not None
                else max(1, min(engine.cfg.default_max_tokens, limit - len(p_ids)))
            )
            why = engine.context_error(len(p_ids), max_tokens)
            if why is not None:
                raise RequestError(why, "messages" if chat else "prompt", "context_length_exceeded")
            pred = None
            if predictor is not None and tok is not None:
                pred = min(predictor.predict(tok.decode(p_ids)), max_tokens)
            for j in range(body.n):
                r = engine.make_request(
                    p_ids,
                    max_tokens,
                    pred,
                    temp,
                    None if body.seed is None else body.seed + j,
                    [] if body.ignore_eos else None,
                    top_k=top_k,
                    top_p=body.top_p if body.top_p is not None else 1.0,
                    logprobs=lp,
                    extra_stop_ids=[*(body.stop_token_ids or []), *eos],
                )
                reqs.append(r)
                outs.append(ChoiceOutput(len(outs), r, tok, body.stop_strings))
        return reqs, outs

    def _usage(reqs, outs) -> Usage:
        pt = sum(len(r.prompt) for r in reqs)
        ct = sum(len(o.tokens) for o in outs)
        return Usage(prompt_tokens=pt, completion_tokens=ct, total_tokens=pt + ct)

    async def _events(stream: _Stream, reqs, outs):
        """Yield ``(choice, delta)`` as tokens arrive, until every choice is done."""
        by_rid = {r.rid: o for r, o in zip(reqs, outs, strict=True)}
        deadline = stream.arrival + engine.cfg.request_timeout_s
        while not all(o.done for o in outs):
            try:
                rid, token, finished, reason = await asyncio.wait_for(
                    stream.q.get(), timeout=max(0.01, deadline - time.monotonic())
                )
            except TimeoutError:
                for o in outs:
                    if not o.done:
                        engine.abort(o.req.rid)
                        o.req.error = f"request timed out after serve.request_timeout_s={engine.cfg.request_timeout_s:g} s"
                        o.finish_reason, o.error = "error", o.req.error
                        yield o, ""
                return
            o = by_rid[rid]
            delta, hit = o.add(token, finished, reason)
            if hit and not finished:
                engine.abort(rid)
            yield o, delta

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
                return _error(
                    404,
                    f"The model '{body.model}' does not exist (this server has '{model_name}')",
                    "model_not_found",
                    "NotFoundError",
                    param="model",
                )
            reqs, outs = _make(body, chat)
        except RequestError as e:
            metrics.requests.labels(status="rejected").inc()
            return _error(400, e.message, e.code, param=e.param)
        except Exception as e:  # noqa: BLE001 - e.g. InputError from the engine
            metrics.requests.labels(status="rejected").inc()
            return _error(400, str(e), "invalid_request")
        stream = _Stream(asyncio.get_running_loop(), t_arrival)
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
                if r.state != "finished":
                    engine.abort(r.rid)
            _finish_metrics(outs, cancelled)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def sse():
                cancelled = True
                try:
                    if chat:
                        for o in outs:
                            yield _sse(
                                ChatCompletionChunk(
                                    id=rid,
                                    created=created,
                                    model=model_name,
                                    choices=[
                                        ChatChunkChoice(
                                            index=o.index,
                                            delta=ChatDelta(role="assistant", content=""),
                                        )
                                    ],
                                )
                            )
                    async for o, delta in _events(stream, reqs, outs):
                        if o.error is not None:
                            err = {
                                "error": {
                                    "message": o.error,
                                    "type": "server_error",
                                    "param": None,
                                    "code": "stage_failure",
                                }
                            }
                            yield f"data: {json.dumps(err)}\n\n"
                            yield "data: [DONE]\n\n"
                            cancelled = False
                            return
                        fr = o.finish_reason
                        if not delta and fr is None:
                            continue
                        if chat:
                            ch = ChatChunkChoice(
                                index=o.index,
                                delta=ChatDelta(content=delta) if delta else ChatDelta(),
                                finish_reason=fr,
                                logprobs=o.chat_logprobs(new_only=True),
                            )
                            chunk = ChatCompletionChunk(
                                id=rid, created=created, model=model_name, choices=[ch]
                            )
                        else:
                            ch = CompletionChoice(
                                index=o.index,
                                text=delta,
                                finish_reason=fr,
                                logprobs=o.completion_logprobs(new_only=True),
                            )
                            chunk = CompletionResponse(
                                id=rid, created=created, model=model_name, choices=[ch]
                            )
                        yield _sse(chunk)
                    if include_usage:
                        cls = ChatCompletionChunk if chat else CompletionResponse
                        yield _sse(
                            cls(
                                id=rid,
                                created=created,
                                model=model_name,
                                choices=[],
                                usage=_usage(reqs, outs),
                            )
                        )
                    yield "data: [DONE]\n\n"
                    cancelled = False
                finally:
                    cleanup(cancelled)

            return StreamingResponse(sse(), media_type="text/event-stream")

        cancelled = True
        try:
            async for _o, _d in _events(stream, reqs, outs):
                pass
            cancelled = False
        finally:
            cleanup(cancelled)
        failed = [o for o in outs if o.error is not None]
        if failed:
            code = "shutting_down" if "shutting down" in failed[0].error else "stage_failure"
            if all(o.req.retryable and not o.tokens for o in outs):
                code = "not_started"  # queued only: safe to send again (the dispatcher does)
            if "timed out" in failed[0].error:
                return _error(504, failed[0].error, "timeout", "server_error")
            return _error(503, failed[0].error, code, "server_error")
        usage = _usage(reqs, outs)
        if chat:
            resp = ChatCompletionResponse(
                id=rid,
                created=created,
                model=model_name,
                usage=usage,
                choices=[
                    ChatChoice(
                        index=o.index,
                        message=ChatMessageOut(content=o.text),
                        finish_reason=o.finish_reason,
                        logprobs=o.chat_logprobs(),
                    )
                    for o in outs
                ],
            )
        else:
            resp = CompletionResponse(
                id=rid,
                created=created,
                model=model_name,
                usage=usage,
                choices=[
                    CompletionChoice(
                        index=o.index,
                        text=o.text,
                        finish_reason=o.finish_reason,
                        logprobs=o.completion_logprobs(),
                    )
                    for o in outs
                ],
            )
        return JSONResponse(resp.model_dump(exclude_none=True))

    @app.get("/health")
    async def health():
        stalled = time.monotonic() - engine.last_loop > engine.cfg.heartbeat_timeout_s
        if engine.accepting and not stalled:
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
        s = engine.sched
        queued = sum(len(r.prompt) + r.max_tokens for r in list(s.waiting))
        return {
            "healthy": engine.accepting,
            "waiting": engine.queue_length,
            "running": len(s.running),
            "queued_tokens": queued,
            "kv_used_fraction": engine.bm.num_used / max(1, engine.bm.num_blocks),
        }

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
        return {
            **counters,
            "scheduler": engine.sched.name,
            "num_stages": engine.num_stages,
            "kv_blocks": engine.bm.num_blocks,
            "kv_used_blocks": engine.bm.num_used,
            "kv_peak_blocks": engine.bm.peak_used,
            "kv_budget_bytes": engine.cfg.kv_budget_bytes,
            "kv_allocated_bytes": engine.kv_bytes,
            "context_limit": engine.context_limit,
            "preemptions": engine.sched.num_preemptions,
            "restarts": engine.restarts,
            "last_failure": engine.failure,
        }

    return app
