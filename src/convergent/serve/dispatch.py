"""Many serving instances behind one dispatcher (``convergent serve --instances N``).

:func:`run_dispatcher` starts N ``convergent serve`` processes on free 127.0.0.1 ports
(instance ``i`` pinned to core ``i mod cores`` with ``serve.dispatch.pin_cpus``), supervises them
(a dead process is restarted while its :class:`~convergent.serve.restarts.RestartBudget`
allows, as the engine's stages: ``serve.faults.max_restarts`` per 10 minutes) and serves the
same OpenAI API on the public port through :class:`Dispatcher`:

* **queue** — each instance gets at most ``serve.dispatch.max_outstanding`` requests; the
  rest wait here, so an instance's death never loses them;
* **routing** — ``load``: the healthy instance with room and the fewest outstanding tokens
  (prompt + max_tokens of the requests it holds), then the lowest KV use it reports on
  ``GET /load`` (polled every 0.5 s); ``round_robin`` for comparison;
* **failover** — a request that could not reach its instance (connection refused, the
  instance restarting) is routed again; one already running on an instance that dies ends
  with a 503 / a stream error event naming the instance. Unhealthy instances get nothing
  until their ``/load`` says healthy again, so the others keep serving meanwhile.

This module runs and supervises the processes; the queue and routing are
:mod:`convergent.serve.dispatch_queue`, the HTTP app and its failover
:mod:`convergent.serve.dispatch_app`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from convergent.serve.config import ServeConfig
from convergent.serve.dispatch_app import create_dispatch_app
from convergent.serve.dispatch_queue import Dispatcher, Instance

__all__ = ["Dispatcher", "Instance", "create_dispatch_app", "run_dispatcher"]


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
    *,
    mdir: Path,
    sc: ServeConfig,
    config: Path | None,
    sets: list[str] | None,
    port: int,
) -> subprocess.Popen:
    """Start one instance's ``convergent serve`` on 127.0.0.1:``port`` (pinned with
    ``serve.dispatch.pin_cpus``; the API key of ``serve.http`` by the environment)."""
    key = sc.http.api_key
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
    cmd += ["--set", "serve.dispatch.instances=1", "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ}
    if key:
        env["CONVERGENT_API_KEY"] = key
    ncpu = os.cpu_count() or 1
    cpu = inst.index % ncpu

    def pin():
        if sc.dispatch.pin_cpus and hasattr(os, "sched_setaffinity"):
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
                if not inst.failures.allows(sc.faults):
                    why = inst.failures.refusal(sc.faults)
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
    config: Path | None = None,
    sets: list[str] | None = None,
) -> None:
    """Start ``serve.dispatch.instances`` instances (or use ``instance_urls``) and serve
    the dispatcher on ``serve.http``'s address until SIGTERM / SIGINT; the instances get
    the same ``config`` and ``sets`` (and the API key)."""
    import uvicorn

    from convergent.models.llama import read_config
    from convergent.serve.executor import free_port
    from convergent.serve.tokenizer import load_tokenizer

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    tok, _ = load_tokenizer(mdir, read_config(mdir).vocab_size)
    d, http = sc.dispatch, sc.http
    external = [u.rstrip("/") for u in d.instance_urls]
    ports = [free_port() for _ in range(0 if external else d.instances)]
    urls = external or [f"http://127.0.0.1:{p}" for p in ports]
    insts = [Instance(i, u) for i, u in enumerate(urls)]
    disp = Dispatcher(insts, d.policy, d.max_outstanding)
    app = create_dispatch_app(disp, http, tok)

    def spawn(inst):
        return _spawn(inst, mdir=mdir, sc=sc, config=config, sets=sets, port=ports[inst.index])

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
        f"dispatching ({d.policy}) over {len(insts)} instances "
        f"({', '.join(i.url for i in insts)}) on http://{http.host}:{http.port}/v1"
    )
    config_ = uvicorn.Config(
        app,
        host=http.host,
        port=http.port,
        log_level="warning",
        timeout_graceful_shutdown=http.shutdown_timeout_s + 5,
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
                    inst.proc.wait(timeout=http.shutdown_timeout_s + 15)
                except subprocess.TimeoutExpired:
                    inst.proc.kill()
