"""Dispatcher benchmark (run through ``python bench/serve_throughput.py --dispatch``).

Real ``convergent serve --instances N`` processes on 127.0.0.1, single-stage instances
(one core each, ``serve.pin_cpus``), driven by an async HTTP client:

* throughput: 2 instances vs 1 on the same trace (all requests submitted at once);
* routing: load-aware vs round-robin p99 latency on a skewed-length trace (2 instances);
* overhead: latency of 1-token requests through the dispatcher minus straight to the
  instance it routed to (same server, interleaved);
* failover: one instance SIGKILLed mid-trace: every request is answered (ok, or an error
  for those running on the dead instance); none is lost or hangs.

Sides are interleaved over ``--rounds`` rounds; medians with min/max are reported, with
the git commit (+dirty), versions, load average before/after and each side's settings.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "serve"))  # servers.py: start/stop a real server


def _git() -> dict:
    def run(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return {
        "commit": run("rev-parse", "HEAD"),
        "dirty": bool(run("status", "--porcelain", "--untracked-files=no")),
    }


def _start(model, run_root, instances, policy, extra=()):
    from servers import start_server

    sets = [
        "serve.scheduler=sequential",
        "serve.torch_threads=1",
        f"serve.dispatch_policy={policy}",
        "serve.max_model_len=512",
        "serve.kv_budget_bytes=67108864",
        *extra,
    ]
    return start_server(model, run_root, *sets, instances=instances)


def _trace(n, seed, skew):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if skew:
            long = rng.random() < 0.15
            out.append((("long " if long else "s ") * (40 if long else 2), 200 if long else 8))
        else:
            out.append((f"prompt {i} " * rng.randint(2, 8), rng.randint(24, 48)))
    return out


async def _fire(base, trace, kill=None):
    import httpx

    lat, toks, status = [], 0, {"ok": 0, "error": 0, "lost": 0}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as c:

        async def one(p, mt):
            nonlocal toks
            t0 = time.monotonic()
            try:
                r = await c.post(
                    base + "/v1/completions",
                    json={"prompt": p, "max_tokens": mt, "ignore_eos": True},
                )
            except Exception:  # noqa: BLE001
                status["lost"] += 1
                return
            if r.status_code == 200:
                status["ok"] += 1
                toks += r.json()["usage"]["completion_tokens"]
                lat.append(time.monotonic() - t0)
            else:
                status["error"] += 1

        t0 = time.monotonic()
        tasks = [asyncio.create_task(one(p, mt)) for p, mt in trace]
        at_kill = None
        if kill is not None:
            await asyncio.sleep(kill[0])
            m = (await c.get(base + "/metrics")).text
            queued = [
                ln for ln in m.splitlines() if ln.startswith("convergent_dispatch_queue_length ")
            ]
            held = [i["outstanding"] for i in (await c.get(base + "/instances")).json()]
            kill[1]()
            at_kill = {
                "dispatcher_queue": float(queued[0].split()[1]),
                "outstanding_per_instance": held,
            }
        await asyncio.gather(*tasks)
        wall = time.monotonic() - t0
    lat.sort()
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None
    return {
        "wall_s": wall,
        "output_tokens": toks,
        "tok_s": toks / wall,
        "p50_s": lat[len(lat) // 2] if lat else None,
        "p99_s": p99,
        **status,
        **({"at_kill": at_kill} if kill is not None else {}),
    }


def _med(xs):
    xs = [x for x in xs if x is not None]
    return (
        {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}
        if xs
        else None
    )


def run(model, out_path, rounds=3, n=48, quick=False):
    import httpx
    from servers import stop_server

    run_root = Path(os.environ.get("TMPDIR", "/tmp")) / f"serve-dispatch-{os.getpid()}"
    run_root.mkdir(parents=True, exist_ok=True)
    res = {
        "git": _git(),
        "loadavg_before": os.getloadavg(),
        "rounds": rounds,
        "requests": n,
        "model": str(model),
        "cores": os.cpu_count(),
    }
    settings = {
        "scheduler": "sequential",
        "torch_threads": 1,
        "pin_cpus": True,
        "max_model_len": 512,
    }
    thr = {"1": [], "2": []}
    trace = _trace(n, 0, skew=False)
    for r in range(rounds):  # sides alternate their order round by round
        for k in ("1", "2") if r % 2 == 0 else ("2", "1"):
            proc, base = _start(model, run_root, int(k), "load")
            try:
                asyncio.run(_fire(base, trace[:4]))  # warm-up
                thr[k].append({"loadavg": os.getloadavg(), **asyncio.run(_fire(base, trace))})
            finally:
                stop_server(proc)
    t1 = _med([x["tok_s"] for x in thr["1"]])
    t2 = _med([x["tok_s"] for x in thr["2"]])
    res["throughput"] = {
        "settings": {**settings, "trace": "uniform, all submitted at once"},
        "one_instance_tok_s": t1,
        "two_instances_tok_s": t2,
        "speedup_median": t2["median"] / t1["median"],
        "runs": thr,
    }
    skew = _trace(n, 1, skew=True)
    pol = {"load": [], "round_robin": []}
    for r in range(rounds):
        for p in ("load", "round_robin") if r % 2 == 0 else ("round_robin", "load"):
            proc, base = _start(model, run_root, 2, p)
            try:
                pol[p].append({"loadavg": os.getloadavg(), **asyncio.run(_fire(base, skew))})
            finally:
                stop_server(proc)
    res["routing"] = {
        "settings": {
            **settings,
            "instances": 2,
            "trace": "15% long (80-word prompt, 200 tokens), rest short",
        },
        "load_p99_s": _med([x["p99_s"] for x in pol["load"]]),
        "round_robin_p99_s": _med([x["p99_s"] for x in pol["round_robin"]]),
        "runs": pol,
    }
    proc, base = _start(model, run_root, 1, "load")
    try:
        inst = httpx.get(base + "/instances").json()[0]["url"]
        via, direct = [], []
        for _ in range(20 if quick else 60):
            for url, xs in ((base, via), (inst, direct)):
                t0 = time.monotonic()
                httpx.post(
                    url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=60
                )
                xs.append(time.monotonic() - t0)
        res["overhead"] = {
            "via_dispatcher_median_s": statistics.median(via),
            "direct_median_s": statistics.median(direct),
            "overhead_per_request_s": statistics.median(via) - statistics.median(direct),
            "requests": len(via),
        }
    finally:
        stop_server(proc)
    fo = []
    for _r in range(rounds):
        proc, base = _start(model, run_root, 2, "load", ("serve.dispatch_max_outstanding=8",))
        try:
            pid = httpx.get(base + "/instances").json()[0]["pid"]
            r = asyncio.run(
                _fire(base, trace, kill=(2.0, lambda pid=pid: os.kill(pid, signal.SIGKILL)))
            )
            r["instances_after"] = httpx.get(base + "/instances").json()
            fo.append(r)
        finally:
            stop_server(proc)
    res["failover"] = {
        "settings": {
            **settings,
            "instances": 2,
            "dispatch_max_outstanding": 8,
            "kill": "instance 0 SIGKILLed 2 s into the trace",
        },
        "runs": fo,
        "lost_total": sum(x["lost"] for x in fo),
        "errors_total": sum(x["error"] for x in fo),
        "ok_total": sum(x["ok"] for x in fo),
    }
    res["loadavg_after"] = os.getloadavg()
    out_path.write_text(json.dumps(res, indent=1, default=str))
    return res
