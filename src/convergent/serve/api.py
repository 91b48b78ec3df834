"""OpenAI-compatible HTTP API over the engine (FastAPI; run with uvicorn).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(both with ``stream: true`` as server-sent events ending in ``data: [DONE]``),
``GET /health`` and ``GET /stats`` (KV usage, peak, budget). With an API key set, every
``/v1`` request needs ``Authorization: Bearer <key>`` (401 otherwise). A prompt whose
length plus ``max_tokens`` exceeds the context limit gets a 400 with an OpenAI-style
error body (``code: context_length_exceeded``). Text is tokenized with the byte-level
:class:`~convergent.serve.tokenizer.ByteTokenizer`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import Request as HTTPRequest  # module level: FastAPI resolves annotations

from convergent.serve.engine import Engine
from convergent.serve.predictor import LengthPredictor
from convergent.serve.scheduler import Request
from convergent.serve.tokenizer import ByteTokenizer, chat_prompt

__all__ = ["create_app"]


def _error(status: int, message: str, code: str, etype: str = "invalid_request_error"):
    from fastapi.responses import JSONResponse

    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": etype, "param": None, "code": code}},
    )


class _Stream:
    """Per-request channel from the engine thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.q: asyncio.Queue = asyncio.Queue()

    def push(self, token: int, finished: bool, reason: str | None) -> None:
        self.loop.call_soon_threadsafe(self.q.put_nowait, (token, finished, reason))


def create_app(
    engine: Engine,
    model_name: str = "convergent-llama",
    api_key: str = "",
    predictor: LengthPredictor | None = None,
):
    """Build the FastAPI app; the engine must be started (:meth:`Engine.start`)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="convergent serve", version="0.1")
    tok = ByteTokenizer(engine.mcfg.vocab_size)
    streams: dict[int, _Stream] = {}
    ctx_limit = min(engine.cfg.max_model_len, engine.bm.capacity_tokens)
    counters = {"requests": 0, "completed": 0, "tokens": 0}

    def on_token(req: Request, token: int, finished: bool) -> None:
        s = streams.get(req.rid)
        if s is not None:
            s.push(token, finished, req.finish_reason)

    engine.on_token = on_token

    def _auth(request: HTTPRequest):
        if not api_key:
            return None
        h = request.headers.get("authorization", "")
        if h != f"Bearer {api_key}":
            return _error(
                401, "invalid or missing API key", "invalid_api_key", "authentication_error"
            )
        return None

    async def _body(request: HTTPRequest) -> dict | Any:
        try:
            body = await request.json()
        except Exception:
            return _error(400, "request body is not valid JSON", "invalid_json")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "invalid_json")
        return body

    def _prepare(prompt_text: str, body: dict):
        ids = tok.encode(prompt_text)
        mt = body.get("max_tokens", body.get("max_completion_tokens"))
        max_tokens = engine.cfg.default_max_tokens if mt is None else mt
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return _error(400, "max_tokens must be a positive integer", "invalid_max_tokens")
        if len(ids) + max_tokens > ctx_limit:
            return _error(
                400,
                f"This model's maximum context length is {ctx_limit} tokens. However, you "
                f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                "context_length_exceeded",
            )
        temp = body.get("temperature", 0.0)
        temp = 0.0 if temp is None else float(temp)
        seed = body.get("seed") or 0
        pred = predictor.predict(prompt_text) if predictor is not None else None
        if pred is not None:
            pred = min(pred, max_tokens)
        stop_ids = [] if body.get("ignore_eos") else None
        req = engine.make_request(ids, max_tokens, pred, temp, int(seed), stop_ids)
        return req

    async def _run(req: Request, stream: _Stream):
        """Yield (token, finished, reason) until the request finishes."""
        while True:
            item = await stream.q.get()
            yield item
            if item[1]:
                break

    def _usage(req: Request, n_out: int) -> dict:
        return {
            "prompt_tokens": len(req.prompt),
            "completion_tokens": n_out,
            "total_tokens": len(req.prompt) + n_out,
        }

    async def _handle(request: HTTPRequest, chat: bool):
        err = _auth(request)
        if err is not None:
            return err
        body = await _body(request)
        if not isinstance(body, dict):
            return body
        if engine.error is not None:
            return _error(500, f"engine failed: {engine.error!r}", "engine_error", "server_error")
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                return _error(400, "'messages' must be a non-empty list", "invalid_messages")
            prompt_text = chat_prompt(msgs)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                return _error(400, "'prompt' must be a string", "invalid_prompt")
            prompt_text = prompt
        req = _prepare(prompt_text, body)
        if not isinstance(req, Request):
            return req
        stream = _Stream(asyncio.get_running_loop())
        streams[req.rid] = stream
        counters["requests"] += 1
        engine.add_request(req)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        if body.get("stream"):

            async def sse():
                n, pending = 0, []
                try:
                    if chat:
                        first = {
                            "id": rid,
                            "object": "chat.completion.chunk",
                            "created": created,
                            "model": model_name,
                            "choices": [
                                {
                                    "index": 0,
                                    "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None,
                                }
                            ],
                        }
                        yield f"data: {json.dumps(first)}\n\n"
                    async for token, finished, reason in _run(req, stream):
                        text = ""
                        if token >= 0:
                            n += 1
                            pending.append(token)
                            text = tok.decode(pending)
                            if text.endswith("\ufffd") and not finished:
                                text = ""  # incomplete UTF-8 sequence: wait for more bytes
                            else:
                                pending = []
                        fr = reason if finished else None
                        if chat:
                            ch = {
                                "index": 0,
                                "delta": {"content": text} if text else {},
                                "finish_reason": fr,
                            }
                            chunk = {
                                "id": rid,
                                "object": "chat.completion.chunk",
                                "created": created,
                                "model": model_name,
                                "choices": [ch],
                            }
                        else:
                            ch = {"index": 0, "text": text, "logprobs": None, "finish_reason": fr}
                            chunk = {
                                "id": rid,
                                "object": "text_completion",
                                "created": created,
                                "model": model_name,
                                "choices": [ch],
                            }
                        if finished:
                            chunk["usage"] = _usage(req, n)
                        if text or finished:
                            yield f"data: {json.dumps(chunk)}\n\n"
                    yield "data: [DONE]\n\n"
                    counters["completed"] += 1
                    counters["tokens"] += n
                finally:
                    streams.pop(req.rid, None)
                    if req.state != "finished":
                        engine.abort(req.rid)

            return StreamingResponse(sse(), media_type="text/event-stream")

        try:
            toks, reason = [], None
            async for token, _finished, r in _run(req, stream):
                if token >= 0:
                    toks.append(token)
                reason = r
        finally:
            streams.pop(req.rid, None)
        counters["completed"] += 1
        counters["tokens"] += len(toks)
        text = tok.decode(toks)
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": reason,
                "logprobs": None,
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        return JSONResponse(
            {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model_name,
                "choices": [choice],
                "usage": _usage(req, len(toks)),
            }
        )

    @app.get("/health")
    async def health():
        return {"status": "ok" if engine.error is None else "error"}

    @app.get("/v1/models")
    async def models(request: HTTPRequest):
        err = _auth(request)
        if err is not None:
            return err
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "convergent"}],
        }

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
            "context_limit": ctx_limit,
            "preemptions": engine.sched.num_preemptions,
        }

    return app
