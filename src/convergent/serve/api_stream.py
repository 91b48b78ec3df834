"""From engine tokens to OpenAI responses (the API's output side).

The engine thread pushes each sampled token into the request's :class:`TokenChannel`;
:func:`events` turns them into ``(choice, text delta)`` on the event loop (ending the
request after ``serve.http.request_timeout_s``), :func:`sse_chunks` renders a streamed answer as
server-sent events ending in ``data: [DONE]`` (or an ``error`` event), and
:func:`final_response` the whole answer (or the 503 / 504 of a failed one).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from convergent.core.fsutil import dumps_json
from convergent.serve.api_requests import error_response, usage_of
from convergent.serve.engine import Engine
from convergent.serve.messages import TokenEvent
from convergent.serve.output import ChoiceOutput
from convergent.serve.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
)
from convergent.serve.scheduler_base import Request

__all__ = ["TokenChannel", "events", "final_response", "sse", "sse_chunks"]


class TokenChannel:
    """Per-HTTP-request channel from the engine thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, arrival: float) -> None:
        self.loop = loop
        self.q: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.arrival = arrival
        self.last: dict[int, float] = {}

    def push(self, ev: TokenEvent) -> None:
        """Hand an engine event to the event loop (thread-safe)."""
        self.loop.call_soon_threadsafe(self.q.put_nowait, ev)


def sse(obj) -> str:
    """One server-sent event carrying a response model (or a dict) as JSON."""
    data = (
        obj.model_dump_json(exclude_none=True)
        if hasattr(obj, "model_dump_json")
        else dumps_json(obj)
    )
    return f"data: {data}\n\n"


async def events(
    engine: Engine,
    stream: TokenChannel,
    reqs: list[Request],
    outs: list[ChoiceOutput],
    timeout_s: float,
) -> AsyncIterator[tuple[ChoiceOutput, str]]:
    """Yield ``(choice, delta)`` as tokens arrive, until every choice is done or
    ``timeout_s`` after the request arrived."""
    by_rid = {r.rid: o for r, o in zip(reqs, outs, strict=True)}
    deadline = stream.arrival + timeout_s
    while not all(o.done for o in outs):
        try:
            ev = await asyncio.wait_for(
                stream.q.get(), timeout=max(0.01, deadline - time.monotonic())
            )
        except TimeoutError:
            for o in outs:
                if not o.done:
                    engine.abort(o.req.rid)
                    o.req.error = (
                        "request timed out after "
                        f"serve.http.request_timeout_s={timeout_s:g} s"
                    )
                    o.finish_reason, o.error = "error", o.req.error
                    yield o, ""
            return
        o = by_rid[ev.rid]
        delta, hit = o.add(ev.token, ev.finished, ev.finish_reason)
        if hit and not ev.finished:
            engine.abort(ev.rid)
        yield o, delta


async def sse_chunks(
    engine: Engine,
    stream: TokenChannel,
    reqs: list[Request],
    outs: list[ChoiceOutput],
    *,
    chat: bool,
    rid: str,
    created: int,
    model_name: str,
    include_usage: bool,
    timeout_s: float,
) -> AsyncIterator[str]:
    """The streamed answer as server-sent events; returns early after an ``error`` event."""
    if chat:
        for o in outs:
            yield sse(
                ChatCompletionChunk(
                    id=rid,
                    created=created,
                    model=model_name,
                    choices=[
                        ChatChunkChoice(
                            index=o.index, delta=ChatDelta(role="assistant", content="")
                        )
                    ],
                )
            )
    async for o, delta in events(engine, stream, reqs, outs, timeout_s):
        if o.error is not None:
            err = {
                "error": {
                    "message": o.error,
                    "type": "server_error",
                    "param": None,
                    "code": "stage_failure",
                }
            }
            yield f"data: {dumps_json(err)}\n\n"
            yield "data: [DONE]\n\n"
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
            chunk = ChatCompletionChunk(id=rid, created=created, model=model_name, choices=[ch])
        else:
            ch = CompletionChoice(
                index=o.index,
                text=delta,
                finish_reason=fr,
                logprobs=o.completion_logprobs(new_only=True),
            )
            chunk = CompletionResponse(id=rid, created=created, model=model_name, choices=[ch])
        yield sse(chunk)
    if include_usage:
        cls = ChatCompletionChunk if chat else CompletionResponse
        yield sse(
            cls(
                id=rid,
                created=created,
                model=model_name,
                choices=[],
                usage=usage_of(reqs, outs),
            )
        )
    yield "data: [DONE]\n\n"


def final_response(
    reqs: list[Request],
    outs: list[ChoiceOutput],
    chat: bool,
    rid: str,
    created: int,
    model_name: str,
):
    """The whole (non-streamed) answer, or the 503 / 504 of a failed request."""
    from fastapi.responses import JSONResponse

    failed = [o for o in outs if o.error is not None]
    if failed:
        code = "shutting_down" if "shutting down" in failed[0].error else "stage_failure"
        if all(o.req.retryable and not o.tokens for o in outs):
            code = "not_started"  # queued only: safe to send again (the dispatcher does)
        if "timed out" in failed[0].error:
            return error_response(504, failed[0].error, "timeout", "server_error")
        return error_response(503, failed[0].error, code, "server_error")
    usage = usage_of(reqs, outs)
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
                    text=o.full_text,
                    finish_reason=o.finish_reason,
                    logprobs=o.completion_logprobs(),
                )
                for o in outs
            ],
        )
    return JSONResponse(resp.model_dump(exclude_none=True))
