"""A real `convergent serve` process on 127.0.0.1 driven by the official openai client."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from convergent.serve.engine import free_port  # noqa: E402

KEY = "test-key-123"
KV_BUDGET = 96 * 1024  # 1 KiB per token for this model -> 96 tokens... of KV over 2 stages


def _wait_ready(base: str, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.log_path.read_text()[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not start")


@pytest.fixture(scope="module")
def server(hf_llama_dir, tmp_path_factory):
    port = free_port()
    run_root = tmp_path_factory.mktemp("runs")
    cmd = [
        sys.executable,
        "-c",
        "from convergent.cli import entry; entry()",
        "serve",
        "--model",
        str(hf_llama_dir),
        "--port",
        str(port),
        "--api-key",
        KEY,
        "--set",
        f"run.root={run_root}",
        "--set",
        "serve.scheduler.kind=tdpipe",
        "--set",
        "serve.scheduler.stages=2",
        "--set",
        "serve.engine.kv_budget_bytes=262144",
        "--set",
        "serve.engine.block_size=4",
        "--set",
        "serve.engine.max_model_len=200",
        "--set",
        "serve.scheduler.predictor=constant",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(run_root / "server.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    proc.log_path = run_root / "server.log"
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, proc)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _client(base, key=KEY):
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)


def test_completion_chat_and_stream(server, hf_llama_dir, hf_greedy):
    c = _client(server)
    assert [m.id for m in c.models.list().data] == ["convergent-llama"]
    r = c.completions.create(
        model="convergent-llama", prompt="Hi", max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == 3
    assert r.choices[0].finish_reason == "length"
    # greedy text equals transformers' greedy tokens decoded by the byte tokenizer
    from convergent.serve.tokenizer import ByteTokenizer

    ref = hf_greedy(hf_llama_dir, [ByteTokenizer().encode("Hi")], 12)[0]
    assert r.choices[0].text == ByteTokenizer(320).decode(ref)
    # streaming gives the same text
    chunks = list(
        c.completions.create(
            model="convergent-llama",
            prompt="Hi",
            max_tokens=12,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    chat = c.chat.completions.create(
        model="convergent-llama",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 8
    stream = c.chat.completions.create(
        model="convergent-llama",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == chat.choices[0].message.content


def test_context_limit_and_api_key(server):
    c = _client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="convergent-llama", prompt="x" * 150, max_tokens=100)
    assert e.value.status_code == 400
    assert "maximum context length is 200 tokens" in str(e.value)
    with pytest.raises(openai.AuthenticationError):
        _client(server, key="wrong").completions.create(
            model="convergent-llama", prompt="hi", max_tokens=2
        )


def _load_test(server, n: int, max_tokens: int = 6):
    async def one(client, i):
        t0 = time.monotonic()
        r = await client.completions.create(
            model="convergent-llama",
            prompt=f"request {i}: " + "ab" * (i % 20),
            max_tokens=max_tokens,
            extra_body={"ignore_eos": True},
        )
        return r, time.monotonic() - t0

    async def main():
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=64)
        async with openai.AsyncOpenAI(
            base_url=server + "/v1",
            api_key=KEY,
            max_retries=0,
            timeout=1200,
            http_client=httpx.AsyncClient(limits=limits, timeout=1200),
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    results = asyncio.run(main())
    assert len(results) == n
    assert all(r.usage.completion_tokens == max_tokens for r, _ in results)
    assert len({r.id for r, _ in results}) == n  # none lost or duplicated
    stats = httpx.get(server + "/stats", timeout=10).json()
    assert stats["kv_peak_blocks"] <= stats["kv_blocks"]
    assert stats["kv_allocated_bytes"] <= stats["kv_budget_bytes"]
    assert stats["kv_used_blocks"] == 0  # everything freed
    lat = sorted(t for _, t in results)
    p50, p99 = lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]
    print(
        f"\nload test: {n} requests, latency p50 {p50:.2f} s, p99 {p99:.2f} s, "
        f"KV peak {stats['kv_peak_blocks']}/{stats['kv_blocks']} blocks, "
        f"preemptions {stats['preemptions']}"
    )
    return p50, p99


def test_concurrent_requests_small(server):
    _load_test(server, 100)


@pytest.mark.slow
def test_concurrent_requests_1000(server):
    _load_test(server, 1000)
