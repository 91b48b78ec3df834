"""The API's input side under load: a body over ``serve.http.max_request_bytes`` is refused
before it is parsed or tokenized (413 naming the setting), and tokenizing a large prompt
runs off the event loop, so a small request concurrent with it is answered first (an
ordering of events, not a timing). The app runs in-process on a real engine."""

from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from convergent.serve.api import create_app  # noqa: E402
from convergent.serve.config import ServeConfig  # noqa: E402
from convergent.serve.engine import Engine  # noqa: E402
from convergent.serve.tokenizer import ByteTokenizer  # noqa: E402


class GatedTokenizer(ByteTokenizer):
    """The byte-level tokenizer, except that a prompt starting with ``BIG`` holds its
    tokenization until the test releases it (and records when it finished)."""

    def __init__(self) -> None:
        super().__init__(320)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.events: list[str] = []
        self.calls = 0

    def encode(self, text: str, bos: bool = True) -> list[int]:
        self.calls += 1
        if text.startswith("BIG"):
            self.entered.set()
            self.release.wait(20)
            self.events.append("big tokenized")
        return super().encode(text, bos)


@pytest.fixture(scope="module")
def engine(hf_llama_dir):
    cfg = ServeConfig(
        engine={"max_model_len": 256},
        scheduler={"kind": "sequential", "profile_costs": False},
        http={"max_request_bytes": 4096},
    )
    eng = Engine(hf_llama_dir, cfg, ignore_eos=True)
    eng.start()
    yield eng
    eng.close()


def _run(app, coro_fn):
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await coro_fn(c)

    return asyncio.run(main())


def test_oversized_body_is_refused_before_tokenizing(engine):
    tok = GatedTokenizer()
    app = create_app(engine, tokenizer=tok)

    async def go(c):
        big = {"prompt": "x" * 5000, "max_tokens": 1}
        declared = await c.post("/v1/completions", json=big)

        async def body():
            for _ in range(8):
                yield b"x" * 1024

        chunked = await c.post(  # no content-length: read until it passes the limit
            "/v1/chat/completions", content=body(), headers={"content-type": "application/json"}
        )
        ok = await c.post("/v1/completions", json={"prompt": "x" * 100, "max_tokens": 1})
        return declared, chunked, ok

    declared, chunked, ok = _run(app, go)
    for r, param in ((declared, "prompt"), (chunked, "messages")):
        err = r.json()["error"]
        assert r.status_code == 413 and err["code"] == "request_too_large"
        assert err["param"] == param and "serve.http.max_request_bytes=4096" in err["message"]
        assert "\n" not in err["message"]
    assert ok.status_code == 200 and tok.calls == 1  # only the allowed one was tokenized


def test_small_request_is_not_held_behind_a_large_ones_tokenization(engine):
    tok = GatedTokenizer()
    app = create_app(engine, tokenizer=tok)

    async def go(c):
        big = asyncio.create_task(
            c.post("/v1/completions", json={"prompt": "BIG" + "y" * 150, "max_tokens": 2})
        )
        assert await asyncio.to_thread(tok.entered.wait, 20)  # the big one is tokenizing
        small = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        tok.events.append("small answered")
        tok.release.set()
        return small, await big

    small, big = _run(app, go)
    assert small.status_code == 200 and big.status_code == 200
    assert tok.events == ["small answered", "big tokenized"]
