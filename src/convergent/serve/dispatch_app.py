"""The dispatcher's HTTP face: the same ``/v1`` routes as an instance, forwarded.

:func:`create_dispatch_app` builds the FastAPI app :func:`~convergent.serve.dispatch.run_dispatcher`
serves. A ``/v1`` POST waits in the :class:`~convergent.serve.dispatch_queue.Dispatcher`'s
queue for an instance with room (its cost estimated by :func:`_estimate_tokens`), is sent
there and routed again while it never started (connection refused, or a 503 whose code is
in :data:`RETRYABLE`); the answer is relayed whole or as server-sent events, ending with an
``instance_failed`` error where the instance dies meanwhile. ``GET /health``,
``/instances`` and ``/metrics`` report on the dispatcher itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
from fastapi import Request as HTTPRequest  # module level: FastAPI resolves annotations
from fastapi.responses import JSONResponse, Response, StreamingResponse

from convergent.core.fsutil import dumps_json
from convergent.serve.config import HttpConfig
from convergent.serve.dispatch_queue import Dispatcher, Instance
from convergent.serve.http_body import BodyTooLarge, read_body, too_large

__all__ = ["RETRYABLE", "create_dispatch_app"]

RETRYABLE = ("engine_restarting", "engine_dead", "shutting_down", "not_started")


def _estimate_tokens(body: dict, tok, default_max: int) -> int:
    """Prompt tokens (counted with the checkpoint's tokenizer where there is one) plus
    the tokens asked for, times ``n``."""

    def count(x) -> int:
        if isinstance(x, str):
            return len(tok.encode(x)) if tok is not None else len(x)
        if isinstance(x, list):
            return sum(count(y) if not isinstance(y, int) else 1 for y in x)
        return 0

    if "messages" in body and isinstance(body["messages"], list):
        p = sum(count(m.get("content")) for m in body["messages"] if isinstance(m, dict))
    else:
        p = count(body.get("prompt"))
    mt = body.get("max_completion_tokens") or body.get("max_tokens") or default_max
    n = body.get("n") or 1
    try:
        return int(p + int(mt)) * max(1, int(n))
    except (TypeError, ValueError):
        return p


def _error_body(message: str, code: str, etype: str = "server_error") -> dict:
    """An OpenAI-style error body."""
    return {"error": {"message": message, "type": etype, "param": None, "code": code}}


def _error(status: int, message: str, code: str, etype: str = "server_error"):
    """An OpenAI-style error response."""
    return JSONResponse(_error_body(message, code, etype), status_code=status)


def _instance_failed(inst: Instance) -> str:
    """The message of a request whose instance died under it."""
    return f"instance {inst.index} failed while the request was running"


def _json_object(raw: bytes) -> dict:
    """The body's JSON object (``{}`` when it is none: an instance answers the 400)."""
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    return body if isinstance(body, dict) else {}


class _Forwarder:
    """Sends ``/v1`` requests to instances, routes again what never started, relays answers."""

    def __init__(self, disp: Dispatcher, http: HttpConfig, tok, client, routed) -> None:
        self.disp = disp
        self.http = http
        self.tok = tok
        self.client = client
        self.routed = routed  # the requests counter, by instance and outcome

    async def forward(self, request: HTTPRequest, path: str):
        """Forward one ``/v1`` POST and relay the instance's answer."""
        try:  # within serve.http.max_request_bytes, then parsed and counted off the event loop
            raw = await read_body(request, self.http.max_request_bytes)
        except BodyTooLarge as e:
            return too_large(e.limit, "messages" if path.endswith("chat/completions") else "prompt")
        body, tokens = await asyncio.to_thread(self.cost, raw)
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() in ("authorization", "content-type")
        }
        stream = body.get("stream") is True
        sent = await self.send(path, raw, headers, tokens)
        if not isinstance(sent, tuple):
            return sent
        inst, resp = sent
        ctype = resp.headers.get("content-type", "application/json")
        if not stream or not ctype.startswith("text/event-stream"):
            return await self.whole(inst, resp, tokens, ctype)
        return StreamingResponse(
            self.relay(inst, resp, tokens), status_code=resp.status_code, media_type=ctype
        )

    def cost(self, raw: bytes) -> tuple[dict, int]:
        """(Worker thread.) The body's JSON object and its estimated tokens."""
        body = _json_object(raw)
        return body, _estimate_tokens(body, self.tok, self.http.default_max_tokens)

    async def send(self, path: str, raw: bytes, headers: dict, tokens: int):
        """``(instance, response)`` of the first instance that took the request, or the error response."""
        deadline = time.monotonic() + self.http.request_timeout_s
        while True:
            inst = await self.disp.acquire(tokens, max(0.0, deadline - time.monotonic()))
            if inst is None:
                return _error(503, "no healthy instance became free in time", "no_instance")
            sent = await self.try_instance(inst, path, raw, headers, tokens)
            if sent is not None:
                return sent

    async def try_instance(self, inst: Instance, path: str, raw: bytes, headers: dict, tokens: int):
        """Send the request to ``inst``: ``(inst, response)``, an error response, or ``None`` to route again."""
        client = self.client
        try:
            req = client.build_request("POST", inst.url + path, content=raw, headers=headers)
            resp = await client.send(req, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout):  # never reached it: again
            await self.reroute(inst, tokens)
            return None
        except httpx.TransportError:  # sent, then the instance died: it was running
            await self.disp.release(inst, tokens)
            await self.disp.set_health(inst, False)
            inst.failed += 1
            self.routed.labels(instance=str(inst.index), status="error").inc()
            return _error(503, _instance_failed(inst), "instance_failed")
        if resp.status_code == 503:
            return await self.refused(inst, resp, tokens)
        return inst, resp

    async def refused(self, inst: Instance, resp, tokens: int):
        """An instance's 503: ``None`` to route again where the request never started there,
        else the 503 relayed."""
        data = await resp.aread()
        await resp.aclose()
        code = ""
        with contextlib.suppress(Exception):
            code = json.loads(data)["error"]["code"]
        if code in RETRYABLE:  # never started there: route it again
            await self.reroute(inst, tokens)
            return None
        await self.disp.release(inst, tokens)
        self.routed.labels(instance=str(inst.index), status="error").inc()
        return Response(data, status_code=503, media_type="application/json")

    async def reroute(self, inst: Instance, tokens: int) -> None:
        """Take a request back from an instance that never ran it (marked unhealthy)."""
        await self.disp.release(inst, tokens)
        await self.disp.set_health(inst, False)
        self.disp.rerouted += 1

    async def done(self, inst: Instance, resp, tokens: int, status: str) -> None:
        """Close an instance's answer, give back its room and count it."""
        await resp.aclose()
        await self.disp.release(inst, tokens)
        inst.served += 1
        self.routed.labels(instance=str(inst.index), status=status).inc()

    async def whole(self, inst: Instance, resp, tokens: int, ctype: str):
        """Relay a non-streamed answer (a 503 naming the instance where it dies meanwhile)."""
        try:
            data = await resp.aread()
            status = "ok" if resp.status_code == 200 else "rejected"
            return Response(data, status_code=resp.status_code, media_type=ctype)
        except httpx.TransportError:
            status = "error"
            inst.failed += 1
            return _error(503, _instance_failed(inst), "instance_failed")
        finally:
            await self.done(inst, resp, tokens, status)

    async def relay(self, inst: Instance, resp, tokens: int):
        """Relay a streamed answer (an error event and ``[DONE]`` where the instance dies meanwhile)."""
        status = "ok"
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.TransportError:
            status = "error"
            inst.failed += 1
            e = _error_body(_instance_failed(inst), "instance_failed")
            yield f"\n\ndata: {dumps_json(e)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await self.done(inst, resp, tokens, status)


def _add_openai_routes(app, fwd: _Forwarder) -> None:
    """``POST /v1/completions`` and ``/v1/chat/completions`` (forwarded), ``GET /v1/models``."""
    disp, client = fwd.disp, fwd.client

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await fwd.forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        return await fwd.forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: HTTPRequest):
        for inst in disp.instances:
            if inst.healthy:
                with contextlib.suppress(httpx.HTTPError):
                    h = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
                    r = await client.get(inst.url + "/v1/models", headers=h)
                    return Response(
                        r.content, status_code=r.status_code, media_type="application/json"
                    )
        return _error(503, "no healthy instance", "no_instance")


def _add_status_routes(app, disp: Dispatcher, reg) -> None:
    """``GET /health``, ``/instances`` and ``/metrics`` of the dispatcher."""
    from prometheus_client import generate_latest

    @app.get("/health")
    async def health():
        up = [i.index for i in disp.instances if i.healthy]
        body = {
            "status": "ok" if up else "unhealthy",
            "healthy_instances": up,
            "instances": len(disp.instances),
        }
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/instances")
    async def instances():
        return [
            {
                "index": i.index,
                "url": i.url,
                "healthy": i.healthy,
                "outstanding": i.outstanding,
                "outstanding_tokens": i.outstanding_tokens,
                "kv_used_fraction": i.kv_used,
                "served": i.served,
                "failed_in_flight": i.failed,
                "restarts": i.restarts,
                "pid": i.proc.pid if i.proc is not None else None,
            }
            for i in disp.instances
        ]

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(reg), media_type="text/plain; version=0.0.4")


def create_dispatch_app(disp: Dispatcher, http: HttpConfig, tok=None):
    """The dispatcher's FastAPI app (the same /v1 routes as an instance) under the
    ``serve.http`` limits (the instances check the API key)."""
    from fastapi import FastAPI
    from prometheus_client import CollectorRegistry, Counter, Gauge

    app = FastAPI(title="convergent dispatcher")
    reg = CollectorRegistry()
    routed = Counter(
        "convergent_dispatch_requests",
        "Requests by instance and outcome",
        ["instance", "status"],
        registry=reg,
    )
    qlen = Gauge(
        "convergent_dispatch_queue_length", "Requests waiting for an instance", registry=reg
    )
    qlen.set_function(lambda: disp.waiting)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(http.request_timeout_s, connect=5.0), limits=limits
    )
    app.state.client = client
    _add_openai_routes(app, _Forwarder(disp, http, tok, client, routed))
    _add_status_routes(app, disp, reg)
    return app
