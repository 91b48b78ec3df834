"""Dispatcher benchmark: ``python -m bench.serve.dispatch`` (or ``python -m
bench.serve.throughput --dispatch``) -> bench/results/serve_dispatch.json.

Real ``convergent serve --instances N`` processes on 127.0.0.1, single-stage instances
(one core each, ``serve.dispatch.pin_cpus``), driven by an async HTTP client:

* throughput: 2 instances vs 1 on the same trace (all requests submitted at once);
* routing: load-aware vs round-robin p99 latency on a skewed-length trace (2 instances);
* overhead: latency of 1-token requests through the dispatcher minus straight to the
  instance it routed to (same server, interleaved);
* failover: one instance SIGKILLed mid-trace: every request is answered (ok, or an error
  for those running on the dead instance); none is lost or hangs.

Every comparison runs its sides interleaved (A B A B …) over ``--rounds`` rounds through
the shared harness (``bench/lib/harness.py``): medians with min/max/IQR, never best-of; the
git commit (+dirty: refused unless ``--allow-dirty``), versions, machine, load average
before/after, each side's settings and the differences that remain between sides.

    python -m bench.serve.dispatch --rounds 3 --requests 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import tempfile
import time
from pathlib import Path

from bench.lib.harness import Side, add_args, check_clean, interleave, summarise, write_result
from bench.lib.paths import RESULTS


def _start(model, run_root, instances, policy, extra=()):
    from tests.serve.servers import start_server

    sets = [
        "serve.scheduler.kind=sequential",
        "serve.engine.torch_threads=1",
        f"serve.dispatch.policy={policy}",
        "serve.engine.max_model_len=512",
        "serve.engine.kv_budget_bytes=268435456",
        *extra,
    ]
    return start_server(model, run_root, *sets, instances=instances)


def _trace(n, seed, skew, rate=None):
    """``[(prompt, max_tokens, arrival_s)]``. Uniform: short prompts, 24-48 tokens. Skewed:
    20% long (40-word prompt, 160 tokens), the rest short (2 words, 16 tokens). ``rate``:
    Poisson arrivals at that many requests/s (seeded); ``None``: all at t=0."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        if skew:
            long = rng.random() < 0.2
            p, mt = ("long " if long else "s ") * (40 if long else 2), 160 if long else 16
        else:
            p, mt = f"prompt {i} " * rng.randint(2, 8), rng.randint(24, 48)
        out.append((p, mt, t))
        if rate:
            t += rng.expovariate(rate)
    return out


async def _fire(base, trace, kill=None):
    import httpx

    lat, toks, status = [], 0, {"ok": 0, "errors": 0, "lost": 0}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as c:
        start = time.monotonic()

        async def one(p, mt, at):
            nonlocal toks
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
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
                status["errors"] += 1

        t0 = time.monotonic()
        tasks = [asyncio.create_task(one(p, mt, at)) for p, mt, at in trace]
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


MAX_OUTSTANDING = 64  # serve.dispatch.max_outstanding's default
# each side's settings in the result (labels kept from the flat layout: the JSON's keys)
SETTINGS = {
    "dispatch_max_outstanding": MAX_OUTSTANDING,
    "scheduler": "sequential",
    "torch_threads": 1,
    "pin_cpus": True,
    "max_model_len": 512,
    "kv_budget_bytes": 268435456,
}


def _served(model, run_root, instances, policy, trace, warmup=4, extra=(), kill_after=None):
    """Start a server, (warm it up,) fire ``trace`` at it, stop it; the client's numbers."""
    import httpx

    from tests.serve.servers import stop_server

    proc, base = _start(model, run_root, instances, policy, extra)
    try:
        if warmup:
            asyncio.run(_fire(base, trace[:warmup]))
        kill = None
        if kill_after is not None:
            pid = httpx.get(base + "/instances").json()[0]["pid"]
            kill = (kill_after, lambda: os.kill(pid, signal.SIGKILL))
        res = asyncio.run(_fire(base, trace, kill=kill))
        if kill is not None:
            res["instances_after"] = httpx.get(base + "/instances").json()
        return res
    finally:
        stop_server(proc)


def _overhead(model, run_root, n: int) -> dict:
    """1-token requests via the dispatcher and straight to its instance, interleaved."""
    import httpx

    from tests.serve.servers import stop_server

    proc, base = _start(model, run_root, 1, "load")
    try:
        inst = httpx.get(base + "/instances").json()[0]["url"]
        via, direct = [], []
        for _ in range(n):
            for url, xs in ((base, via), (inst, direct)):
                t0 = time.monotonic()
                httpx.post(
                    url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=60
                )
                xs.append(time.monotonic() - t0)
    finally:
        stop_server(proc)
    sv, sd = summarise(via), summarise(direct)
    return {
        "via_dispatcher_s": sv,
        "direct_s": sd,
        "via_dispatcher_median_s": sv["median"],
        "direct_median_s": sd["median"],
        "overhead_per_request_s": sv["median"] - sd["median"],
        "requests": len(via),
    }


def _section(res) -> dict:
    d = res.to_dict()
    for k in ("provenance", "benchmark", "commit", "dirty"):
        d.pop(k, None)
    return d


def run(model, rounds: int = 3, n: int = 128, quick: bool = False, n_skew: int = 96,
        skew_rate: float = 7.0) -> dict:
    """All four comparisons; returns the result dict (commit, provenance, sections)."""
    from bench.lib.harness import provenance

    run_root = Path(os.environ.get("TMPDIR", "/tmp")) / f"serve-dispatch-{os.getpid()}"
    run_root.mkdir(parents=True, exist_ok=True)
    prov = provenance()
    trace = _trace(n, 0, skew=False)
    same = ["same model, trace, client and settings; only the instance count differs",
            "the 1-instance side uses one core, the 2-instance side two (that is the point)",
            f"{n} requests at t=0: more than one instance admits "
            f"(serve.dispatch.max_outstanding={MAX_OUTSTANDING}), so each instance runs "
            "saturated, as when one adds instances; the rest wait at the dispatcher"]
    thr = interleave(
        "serve_dispatch.throughput",
        [Side("one_instance", lambda r: _served(model, run_root, 1, "load", trace),
              {**SETTINGS, "instances": 1}),
         Side("two_instances", lambda r: _served(model, run_root, 2, "load", trace),
              {**SETTINGS, "instances": 2})],
        rounds=rounds, differences=same,
    )
    skew = _trace(n_skew, 1, skew=True, rate=skew_rate)
    routing = interleave(
        "serve_dispatch.routing",
        [Side("load", lambda r: _served(model, run_root, 2, "load", skew, warmup=0),
              {**SETTINGS, "instances": 2, "dispatch_policy": "load"}),
         Side("round_robin", lambda r: _served(model, run_root, 2, "round_robin", skew, warmup=0),
              {**SETTINGS, "instances": 2, "dispatch_policy": "round_robin"})],
        rounds=rounds,
        differences=[f"only serve.dispatch.policy differs; same skewed trace of {n_skew} "
                     "requests (20% long: 40-word prompt, 160 tokens; the rest 2 words, "
                     f"16 tokens), Poisson arrivals at {skew_rate} requests/s (seed 1)"],
    )
    over = _overhead(model, run_root, 20 if quick else 40)
    fo_settings = {**SETTINGS, "instances": 2, "dispatch_max_outstanding": 8,
                   "kill": "instance 0 SIGKILLed 2 s into the trace"}
    failover = interleave(
        "serve_dispatch.failover",
        [Side("kill_one_of_two", lambda r: _served(
            model, run_root, 2, "load", trace, warmup=0,
            extra=("serve.dispatch.max_outstanding=8",), kill_after=2.0), fo_settings)],
        rounds=rounds,
    )
    fo_rows = failover.per_round["kill_one_of_two"]
    t1 = thr.summary["one_instance"]["tok_s"]
    t2 = thr.summary["two_instances"]["tok_s"]
    prov["load_avg_after"] = list(os.getloadavg())
    return {
        "benchmark": "serve_dispatch",
        "commit": prov["commit"],
        "dirty": prov["dirty"],
        "provenance": prov,
        "rounds": rounds,
        "requests": n,
        "skew_requests": n_skew,
        "skew_rate_per_s": skew_rate,
        "model": str(model),
        # headline keys (issue 22): read by the README and the issue checks
        "speedup_median": thr.ratio("two_instances", "one_instance", "tok_s"),
        "load_p99_s_median": routing.median("load", "p99_s"),
        "round_robin_p99_s_median": routing.median("round_robin", "p99_s"),
        "overhead_per_request_s": over["overhead_per_request_s"],
        "lost_total": sum(x["lost"] for x in fo_rows),
        "throughput": {
            **_section(thr),
            "one_instance_tok_s": t1,
            "two_instances_tok_s": t2,
            "speedup_median": thr.ratio("two_instances", "one_instance", "tok_s"),
            "speedup_per_round": [
                b["tok_s"] / a["tok_s"]
                for a, b in zip(thr.per_round["one_instance"], thr.per_round["two_instances"],
                                strict=True)
            ],
        },
        "routing": {
            **_section(routing),
            "load_p99_s": routing.summary["load"]["p99_s"],
            "round_robin_p99_s": routing.summary["round_robin"]["p99_s"],
        },
        "overhead": over,
        "failover": {
            **_section(failover),
            "lost_total": sum(x["lost"] for x in fo_rows),
            "errors_total": sum(x["errors"] for x in fo_rows),
            "ok_total": sum(x["ok"] for x in fo_rows),
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(ap, default_out=str(RESULTS / "serve_dispatch.json"), rounds=3)
    ap.add_argument("--requests", type=int, default=128, help="throughput trace")
    ap.add_argument("--skew-requests", type=int, default=96, help="routing trace")
    ap.add_argument("--skew-rate", type=float, default=7.0, help="routing arrivals/s")
    ap.add_argument("--quick", action="store_true", help="fewer overhead probes")
    ap.add_argument("--model-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    check_clean(args)
    from convergent.serve.offline import ensure_random_model

    mdir = args.model_dir or Path(tempfile.gettempdir()) / "convergent-serve-30m"
    ensure_random_model(mdir, "30m", seed=0)
    res = run(mdir, args.rounds, args.requests, args.quick, args.skew_requests, args.skew_rate)
    write_result(res, args)
    keys = ("speedup_median", "load_p99_s_median", "round_robin_p99_s_median",
            "overhead_per_request_s", "lost_total")
    print(json.dumps({k: res[k] for k in keys}, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
