"""`convergent serve --instances 2`: routing, failover when an instance is SIGKILLed
mid-trace (queued requests re-routed, in-flight ones ended with an error), restart, and
a clean SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

from convergent.serve.dispatch import Dispatcher, Instance  # noqa: E402
from tests.serve.servers import start_server, stop_server, wait_health  # noqa: E402


def test_routing_policies():
    async def main():
        insts = [Instance(i, f"http://127.0.0.1:{i}", healthy=True) for i in range(3)]
        d = Dispatcher(insts, "load", max_outstanding=2)
        a = await d.acquire(100, 1)
        b = await d.acquire(10, 1)
        c = await d.acquire(10, 1)
        assert (a.index, b.index, c.index) == (0, 1, 2)
        e = await d.acquire(50, 1)  # fewest outstanding tokens: 1 or 2 (10 each) -> 1
        assert e.index == 1
        f = await d.acquire(5, 1)
        assert f.index == 2
        await d.set_health(insts[0], False)
        assert await d.acquire(1, 0.2) is None  # 0 unhealthy, 1 and 2 full: it waits
        await d.release(e, 50)
        assert (await d.acquire(1, 1)).index == 1
        rr = Dispatcher([Instance(i, "", healthy=True) for i in range(2)], "round_robin", 10)
        got = [(await rr.acquire(1000 if i == 0 else 1, 1)).index for i in range(4)]
        assert got == [0, 1, 0, 1]  # ignores load

    asyncio.run(main())


@pytest.fixture()
def dispatched(hf_llama_dir, tmp_path):
    proc, base = start_server(
        hf_llama_dir,
        tmp_path,
        "serve.scheduler.kind=sequential",
        "serve.dispatch.max_outstanding=2",
        "serve.engine.max_model_len=256",
        instances=2,
    )
    yield proc, base
    stop_server(proc)


def test_failover_loses_no_queued_request(dispatched):
    proc, base = dispatched
    insts = httpx.get(base + "/instances", timeout=10).json()
    assert [i["healthy"] for i in insts] == [True, True]
    victim = insts[0]["pid"]
    n = 12

    async def main():
        async with openai.AsyncOpenAI(
            base_url=base + "/v1", api_key="x", max_retries=0, timeout=300
        ) as c:

            async def one(i):
                try:
                    r = await c.completions.create(
                        model="convergent-llama",
                        prompt=f"q{i}",
                        max_tokens=120,
                        extra_body={"ignore_eos": True},
                    )
                    return r
                except openai.APIError as e:
                    return e

            tasks = [asyncio.create_task(one(i)) for i in range(n)]
            for _ in range(600):  # wait until instance 0 holds requests, then kill it
                await asyncio.sleep(0.05)
                st = httpx.get(base + "/instances", timeout=10).json()
                if st[0]["outstanding"] > 0:
                    break
            os.kill(victim, signal.SIGKILL)
            return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    ok = [r for r in results if not isinstance(r, Exception)]
    failed = [r for r in results if isinstance(r, Exception)]
    # only those running on the dead instance (at most its cap of 2) end with an error
    assert 1 <= len(failed) <= 2, failed
    assert all("instance 0 failed" in str(e) for e in failed)
    assert len(ok) + len(failed) == n
    assert all(r.usage.completion_tokens == 120 for r in ok)
    # the dispatcher kept serving, restarted the instance, and routes to it again
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        st = httpx.get(base + "/instances", timeout=10).json()
        if st[0]["healthy"] and st[0]["restarts"] == 1:
            break
        time.sleep(0.5)
    assert st[0]["healthy"] and st[0]["restarts"] == 1 and st[0]["pid"] != victim
    assert st[0]["failed_in_flight"] == len(failed)
    assert st[1]["served"] >= n - 2 - st[0]["served"]
    wait_health(base)
    c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
    assert (
        c.completions.create(
            model="convergent-llama", prompt="after", max_tokens=3
        ).usage.completion_tokens
        >= 1
    )


def test_sigterm_stops_dispatcher_and_instances(dispatched):
    proc, base = dispatched
    pids = [i["pid"] for i in httpx.get(base + "/instances", timeout=10).json()]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0
    time.sleep(0.5)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)


def test_dispatch_to_instances_started_elsewhere(hf_llama_dir, tmp_path):
    """serve.dispatch.instance_urls: the dispatcher routes to running instances (one per node on a
    cluster) instead of starting its own."""
    inst, url = start_server(hf_llama_dir, tmp_path, "serve.scheduler.kind=sequential")
    try:
        proc, base = start_server(
            hf_llama_dir, tmp_path, f'serve.dispatch.instance_urls=["{url}"]', instances=1
        )
        try:
            st = httpx.get(base + "/instances", timeout=10).json()
            assert [i["url"] for i in st] == [url] and st[0]["pid"] is None
            c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
            r = c.completions.create(
                model="convergent-llama", prompt="hi", max_tokens=4, extra_body={"ignore_eos": True}
            )
            assert r.usage.completion_tokens == 4
            assert httpx.get(base + "/instances", timeout=10).json()[0]["served"] == 1
        finally:
            assert stop_server(proc) == 0
        assert inst.poll() is None  # not the dispatcher's to stop
    finally:
        stop_server(inst)
