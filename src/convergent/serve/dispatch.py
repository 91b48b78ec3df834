"""Many serving instances behind one dispatcher (``convergent serve --instances N``).

:func:`run_dispatcher` starts N ``convergent serve`` processes on free 127.0.0.1 ports
(instance ``i`` pinned to core ``i mod cores`` with ``serve.pin_cpus``), supervises them
(a dead process is restarted while its :class:`~convergent.serve.restarts.RestartBudget`
allows, as the engine's stages: ``serve.max_restarts`` per 10 minutes) and serves the
same OpenAI API on the public port through :class:`Dispatcher`:

* **queue** — each instance gets at most ``serve.dispatch_max_outstanding`` requests; the
  rest wait here, so an instance's death never loses them;
* **routing** — ``load``: the healthy instance with room and the fewest outstanding tokens
  (prompt + max_tokens of the requests it holds), then the lowest KV use it reports on
  ``GET /load`` (polled every 0.5 s); ``round_robin`` for comparison;
* **failover** — a request that could not reach its instance (connection refused, the
  instance restarting) is routed again; one already running on an instance that dies ends
  with a 503 / a stream error event naming the instance. Unhealthy instances get nothing
  until their ``/load`` says healthy again, so the others keep serving meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request as HTTPRequest  # module level: FastAPI resolves annotations

from convergent.fsutil import dumps_json
from convergent.serve.config import ServeConfig
from convergent.serve.restarts import RestartBudget

__all__ = ["Dispatcher", "Instance", "create_dispatch_app", "run_dispatcher"]

RETRYABLE = ("engine_restarting", "engine_dead", "shutting_down", "not_started")


@dataclass
class Instance:
    """One serving instance as the dispatcher sees it."""

    index: int
    url: str
    healthy: bool = False
    outstanding: int = 0  # requests forwarded and not finished
    outstanding_tokens: int = 0
    kv_used: float = 0.0
    served: int = 0
    failed: int = 0
    proc: subprocess.Popen | None = None
    restarts: int = 0
    failures: RestartBudget = field(default_factory=RestartBudget)  # its exits


class Dispatcher:
    """Admission queue and routing over instances (all on one asyncio loop)."""

    def __init__(self, instances: list[Instance], policy: str = "load", max_outstanding: int = 64):
        self.instances = instances
        self.policy = policy
        self.max_outstanding = max_outstanding
        self._cond: asyncio.Condition | None = None
        self._rr = itertools.count()
        self.waiting = 0
        self.rerouted = 0

    @property
    def cond(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    def pick(self) -> Instance | None:
        ok = [i for i in self.instances if i.healthy and i.outstanding < self.max_outstanding]
        if not ok:
            return None
        if self.policy == "round_robin":
            n = len(self.instances)
            start = next(self._rr)
            for k in range(n):
                inst = self.instances[(start + k) % n]
                if inst in ok:
                    return inst
        return min(ok, key=lambda i: (i.outstanding_tokens, i.kv_used, i.index))

    async def acquire(self, tokens: int, timeout: float) -> Instance | None:
        """Wait (FIFO-ish) for an instance with room; ``None`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        async with self.cond:
            self.waiting += 1
            try:
                while (inst := self.pick()) is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.cond.wait(), timeout=min(left, 0.5))
                inst.outstanding += 1
                inst.outstanding_tokens += tokens
                return inst
            finally:
                self.waiting -= 1

    async def release(self, inst: Instance, tokens: int) -> None:
        async with self.cond:
            inst.outstanding -= 1
            inst.outstanding_tokens -= tokens
            self.cond.notify_all()

    async def set_health(self, inst: Instance, healthy: bool, kv: float | None = None) -> None:
        async with self.cond:
            inst.healthy = healthy
            if kv is not None:
                inst.kv_used = kv
            self.cond.notify_all()


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


def create_dispatch_app(disp: Dispatcher, sc: ServeConfig, tok=None, api_key: str = ""):
    """The dispatcher's FastAPI app (the same /v1 routes as an instance)."""
    import httpx
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

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
        timeout=httpx.Timeout(sc.request_timeout_s, connect=5.0), limits=limits
    )
    app.state.client = client

    def err(status, message, code, etype="server_error"):
        return JSONResponse(
            {"error": {"message": message, "type": etype, "param": None, "code": code}},
            status_code=status,
        )

    async def forward(request: HTTPRequest, path: str):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):  # let an instance produce the 400
            body = {}
        tokens = _estimate_tokens(body, tok, sc.default_max_tokens)
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() in ("authorization", "content-type")
        }
        stream = body.get("stream") is True
        deadline = time.monotonic() + sc.request_timeout_s
        while True:
            inst = await disp.acquire(tokens, max(0.0, deadline - time.monotonic()))
            if inst is None:
                return err(503, "no healthy instance became free in time", "no_instance")
            url = inst.url + path
            try:
                req = client.build_request("POST", url, content=raw, headers=headers)
                resp = await client.send(req, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout):  # never reached it: again
                await disp.release(inst, tokens)
                await disp.set_health(inst, False)
                disp.rerouted += 1
                continue
            except httpx.TransportError:  # sent, then the instance died: it was running
                await disp.release(inst, tokens)
                await disp.set_health(inst, False)
                inst.failed += 1
                routed.labels(instance=str(inst.index), status="error").inc()
                return err(
                    503,
                    f"instance {inst.index} failed while the request was running",
                    "instance_failed",
                )
            if resp.status_code == 503:
                data = await resp.aread()
                await resp.aclose()
                code = ""
                with contextlib.suppress(Exception):
                    code = json.loads(data)["error"]["code"]
                if code in RETRYABLE:  # never started there: route it again
                    await disp.release(inst, tokens)
                    await disp.set_health(inst, False)
                    disp.rerouted += 1
                    continue
                await disp.release(inst, tokens)
                routed.labels(instance=str(inst.index), status="error").inc()
                return Response(data, status_code=503, media_type="application/json")
            break
        ctype = resp.headers.get("content-type", "application/json")
        if not stream or not ctype.startswith("text/event-stream"):
            try:
                data = await resp.aread()
                status = "ok" if resp.status_code == 200 else "rejected"
                return Response(data, status_code=resp.status_code, media_type=ctype)
            except httpx.TransportError:
                status = "error"
                inst.failed += 1
                return err(
                    503,
                    f"instance {inst.index} failed while the request was running",
                    "instance_failed",
                )
            finally:
                await resp.aclose()
                await disp.release(inst, tokens)
                inst.served += 1
                routed.labels(instance=str(inst.index), status=status).inc()

        async def relay():
            status = "ok"
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.TransportError:
                status = "error"
                inst.failed += 1
                e = {
                    "error": {
                        "message": f"instance {inst.index} failed while the request was running",
                        "type": "server_error",
                        "param": None,
                        "code": "instance_failed",
                    }
                }
                yield f"\n\ndata: {dumps_json(e)}\n\ndata: [DONE]\n\n".encode()
            finally:
                await resp.aclose()
                await disp.release(inst, tokens)
                inst.served += 1
                routed.labels(instance=str(inst.index), status=status).inc()

        return StreamingResponse(relay(), status_code=resp.status_code, media_type=ctype)

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        return await forward(request, "/v1/chat/completions")

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
        return err(503, "no healthy instance", "no_instance")

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

    return app


async def _watch(disp: Dispatcher, client, poll_s: float = 0.5) -> None:
    """Poll every instance's ``/load`` (health and KV use)."""
    while True:
        for inst in disp.instances:
            try:
                r = await client.get(inst.url + "/load", timeout=2.0)
                d = r.json()
                await disp.set_health(
                    inst, bool(d.get("healthy")), float(d.get("kv_used_fraction", 0))
                )
            except Exception:  # noqa: BLE001 - down or starting
                await disp.set_health(inst, False)
        await asyncio.sleep(poll_s)


def _spawn(
    inst: Instance,
    mdir: Path,
    sc: ServeConfig,
    key: str,
    config: Path | None,
    sets: list[str] | None,
    port: int,
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-c",
        "from convergent.cli import entry; entry()",
        "serve",
        "--model",
        str(mdir),
    ]
    if config is not None:
        cmd += ["--config", str(config)]
    for s in sets or []:
        cmd += ["--set", s]
    cmd += ["--set", "serve.instances=1", "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ}
    if key:
        env["CONVERGENT_API_KEY"] = key
    ncpu = os.cpu_count() or 1
    cpu = inst.index % ncpu

    def pin():
        if sc.pin_cpus and hasattr(os, "sched_setaffinity"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, {cpu})

    inst.proc = subprocess.Popen(cmd, env=env, preexec_fn=pin)  # noqa: PLW1509
    return inst.proc


async def _supervise(
    disp: Dispatcher,
    spawn: Callable[[Instance], subprocess.Popen],
    sc: ServeConfig,
    log: Callable[[str], None],
) -> None:
    """Restart instance processes that exit, while each one's restart budget allows
    (:class:`~convergent.serve.restarts.RestartBudget`, as the engine's stages)."""
    while True:
        for inst in disp.instances:
            if inst.proc is not None and inst.proc.poll() is not None:
                code = inst.proc.returncode
                await disp.set_health(inst, False)
                inst.failures.record()
                if not inst.failures.allows(sc):
                    why = inst.failures.refusal(sc)
                    log(f"instance {inst.index} exited ({code}); not restarted ({why})")
                    inst.proc = None
                    continue
                log(f"instance {inst.index} exited ({code}); restarting it")
                inst.restarts += 1
                spawn(inst)
        await asyncio.sleep(0.2)


def run_dispatcher(
    mdir: Path,
    sc: ServeConfig,
    host: str,
    port: int,
    key: str,
    config: Path | None = None,
    sets: list[str] | None = None,
) -> None:
    """Start ``sc.instances`` instances and serve the dispatcher until SIGTERM / SIGINT."""
    import uvicorn

    from convergent.models.llama import read_config
    from convergent.serve.executor import free_port
    from convergent.serve.tokenizer import load_tokenizer

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    tok, _ = load_tokenizer(mdir, read_config(mdir).vocab_size)
    external = [u.rstrip("/") for u in sc.instance_urls]
    ports = [free_port() for _ in range(0 if external else sc.instances)]
    urls = external or [f"http://127.0.0.1:{p}" for p in ports]
    insts = [Instance(i, u) for i, u in enumerate(urls)]
    disp = Dispatcher(insts, sc.dispatch_policy, sc.dispatch_max_outstanding)
    app = create_dispatch_app(disp, sc, tok, key)

    def spawn(inst):
        return _spawn(inst, mdir, sc, key, config, sets, ports[inst.index])

    if not external:
        for inst in insts:
            spawn(inst)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        tasks = [
            asyncio.create_task(_watch(disp, app.state.client)),
        ]
        if not external:
            tasks.append(asyncio.create_task(_supervise(disp, spawn, sc, log)))
        yield
        for t in tasks:
            t.cancel()

    app.router.lifespan_context = lifespan

    log(
        f"dispatching ({sc.dispatch_policy}) over {len(insts)} instances "
        f"({', '.join(i.url for i in insts)}) on http://{host}:{port}/v1"
    )
    config_ = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=sc.shutdown_timeout_s + 5,
    )
    from convergent.serve.server import quiet_signals

    quiet_signals()
    try:
        uvicorn.Server(config_).run()
    finally:
        for inst in insts:
            if inst.proc is not None and inst.proc.poll() is None:
                inst.proc.terminate()
        for inst in insts:
            if inst.proc is not None:
                try:
                    inst.proc.wait(timeout=sc.shutdown_timeout_s + 15)
                except subprocess.TimeoutExpired:
                    inst.proc.kill()
