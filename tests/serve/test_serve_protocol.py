"""The strict OpenAI API: malformed requests -> 400 naming the field; stop, n, seed,
top-k/top-p and logprobs exact against transformers; Prometheus metrics names."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from convergent.serve.tokenizer import ByteTokenizer  # noqa: E402
from tests.serve.servers import start_server, stop_server  # noqa: E402

BT = ByteTokenizer(320)


@pytest.fixture(scope="module")
def server(hf_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("proto")
    proc, base = start_server(
        hf_llama_dir,
        root,
        "serve.scheduler.kind=sequential",
        "serve.engine.max_model_len=200",
        "serve.engine.kv_budget_bytes=262144",
    )
    yield base
    stop_server(proc)


@pytest.fixture(scope="module")
def hf_model(hf_llama_dir):
    return transformers.LlamaForCausalLM.from_pretrained(hf_llama_dir).eval()


def _client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)


C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
MALFORMED = [
    (C, b"{not json", None),
    (C, b"[1, 2]", None),
    (C, {"max_tokens": 3}, "prompt"),
    (C, {"prompt": 5}, "prompt"),
    (C, {"prompt": "a", "max_tokens": "3"}, "max_tokens"),
    (C, {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    (C, {"prompt": "a", "max_tokens": 2.5}, "max_tokens"),
    (C, {"prompt": "a", "temperature": -0.1}, "temperature"),
    (C, {"prompt": "a", "temperature": "hot"}, "temperature"),
    (C, {"prompt": "a", "temperature": 3}, "temperature"),
    (C, {"prompt": "a", "top_p": 0}, "top_p"),
    (C, {"prompt": "a", "top_p": 1.5}, "top_p"),
    (C, {"prompt": "a", "top_k": -2}, "top_k"),
    (C, {"prompt": "a", "n": 0}, "n"),
    (C, {"prompt": "a", "n": 100}, "n"),
    (C, {"prompt": "a", "logprobs": 50}, "logprobs"),
    (C, {"prompt": "a", "stop": 7}, "stop"),
    (C, {"prompt": "a", "stop": [""]}, None),
    (C, {"prompt": "a", "seed": "1"}, "seed"),
    (C, {"prompt": "a", "stream": "yes"}, "stream"),
    (C, {"prompt": "a", "frobnicate": 1}, "frobnicate"),
    (C, {"prompt": "a", "logit_bias": {"5": 1}}, "logit_bias"),
    (C, {"prompt": "a", "presence_penalty": 0.5}, "presence_penalty"),
    (C, {"prompt": "a", "echo": True, "stream": True}, "echo"),
    (CH, {"messages": MSG, "echo": True}, "echo"),
    (C, {"prompt": [1, 2, 999]}, "prompt"),
    (C, {"prompt": "a", "stop_token_ids": [5000]}, "stop_token_ids"),
    (C, {"prompt": "a" * 150, "max_tokens": 100}, "prompt"),
    (CH, {"messages": []}, "messages"),
    (CH, {"messages": "hi"}, "messages"),
    (CH, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    (CH, {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    (CH, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (CH, {"messages": MSG, "response_format": {"type": "json_object"}}, "response_format"),
    (CH, {"messages": MSG, "top_logprobs": 2}, None),
    (CH, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CH, {"messages": MSG, "max_completion_tokens": -1}, "max_completion_tokens"),
]


def test_malformed_requests_get_400_naming_the_field(server):
    assert len(MALFORMED) >= 20
    for path, body, param in MALFORMED:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(
            server + path, timeout=30, headers={"content-type": "application/json"}, **kw
        )
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["message"]
        if param is not None:
            assert err["param"] == param, (body, err)
            assert (
                param.split(".")[0].split("[")[0] in err["message"]
                or "context length" in err["message"]
            ), err
    # another model's name: 404, as vLLM answers
    with pytest.raises(openai.NotFoundError) as e:
        _client(server).completions.create(model="gpt-4", prompt="a", max_tokens=1)
    assert e.value.body["param"] == "model"
    # the openai client sees a BadRequestError with the field
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).completions.create(model="convergent-llama", prompt="a", temperature=-1)
    assert "temperature" in str(e.value)


def _ref_greedy(model, ids, n, eos=None):
    g = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return g[0, len(ids) :].tolist()


def test_stop_strings_and_stop_token_ids(server, hf_model):
    c = _client(server)
    ids = BT.encode("stop me")
    ref = _ref_greedy(hf_model, ids, 40)
    # stop token id: transformers with that id as eos stops at the same token
    stop_id = ref[6]
    hf_stop = _ref_greedy(hf_model, ids, 40, eos=[stop_id])
    r = c.completions.create(
        model="convergent-llama",
        prompt="stop me",
        max_tokens=40,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(hf_stop)
    assert r.choices[0].text == BT.decode(hf_stop[:-1])
    # stop string: the text ends right before its first occurrence in the reference text
    text = BT.decode(ref)
    ascii_at = [
        i
        for i in range(3, len(text) - 2)
        if text[i : i + 2].isprintable() and text[i : i + 2].isascii()
    ]
    if not ascii_at:
        pytest.skip("reference text has no printable ASCII pair")
    s = text[ascii_at[0] : ascii_at[0] + 2]
    r = c.completions.create(
        model="convergent-llama",
        prompt="stop me",
        max_tokens=40,
        stop=[s, "\x00never"],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(s)]
    chunks = list(
        c.completions.create(
            model="convergent-llama",
            prompt="stop me",
            max_tokens=40,
            stop=s,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text[: text.index(s)]


def _ref_sample(model, ids, n, seed, temperature, top_k=0, top_p=1.0):
    """Our sampler's definition on transformers' logits and warpers."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from convergent.serve.sampling import seeded_gumbel

    ids, out = list(ids), []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[:, -1].float()
        x = TemperatureLogitsWarper(temperature)(None, logits)
        if top_k:
            x = TopKLogitsWarper(top_k)(None, x)
        if top_p < 1:
            x = TopPLogitsWarper(top_p)(None, x)
        # the Gumbel-max draw with the row's seed (request seed, position)
        noise = seeded_gumbel(torch.tensor([seed * 1_000_003 + len(ids)]), x.shape[-1])
        t = int((torch.log_softmax(x, -1) + noise).argmax(-1))
        out.append(t)
        ids.append(t)
    return out


def test_n_seed_top_k_top_p_match_reference(server, hf_model):
    c = _client(server)
    ids = BT.encode("seed")
    greedy = _ref_greedy(hf_model, ids, 10)
    r = c.completions.create(
        model="convergent-llama", prompt="seed", max_tokens=10, n=3, extra_body={"ignore_eos": True}
    )
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert all(ch.text == BT.decode(greedy) for ch in r.choices)
    assert r.usage.completion_tokens == 30
    kw = dict(
        model="convergent-llama",
        prompt=[ids],
        max_tokens=12,
        temperature=0.9,
        top_p=0.8,
        seed=7,
        logprobs=0,
        extra_body={"ignore_eos": True, "top_k": 20},
    )
    a = c.completions.create(n=2, **kw)
    b = c.completions.create(n=1, **{**kw, "seed": 8})
    for j, seed in enumerate((7, 8)):
        ref = _ref_sample(hf_model, ids, 12, seed, 0.9, top_k=20, top_p=0.8)
        assert a.choices[j].text == BT.decode(ref)
    assert a.choices[1].text == b.choices[0].text
    assert a.choices[0].text != a.choices[1].text


def test_logprobs_match_transformers(server, hf_model):
    c = _client(server)
    ids = BT.encode("lp")
    r = c.completions.create(
        model="convergent-llama",
        prompt="lp",
        max_tokens=6,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    ref = hf_model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=6,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    lp = r.choices[0].logprobs
    for t, logits in enumerate(ref.logits):
        ls = torch.log_softmax(logits[0].float(), -1)
        tok = int(ref.sequences[0, len(ids) + t])
        assert abs(lp.token_logprobs[t] - float(ls[tok])) < 1e-4
        top = torch.topk(ls, 3)
        # keyed by token text (OpenAI's format): ids decoding to the same text share a key
        got = list(lp.top_logprobs[t].values())
        assert got and all(min(abs(v - w) for w in top.values.tolist()) < 1e-4 for v in got)
        assert max(got) == pytest.approx(float(top.values[0]), abs=1e-4)
    chat = c.chat.completions.create(
        model="convergent-llama",
        messages=MSG,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(x.top_logprobs) == 2 for x in content)
    assert all(x.logprob <= x.top_logprobs[0].logprob + 1e-6 for x in content)


def test_echo_gives_prompt_logprobs_of_transformers(server, hf_model):
    """``echo`` with ``max_tokens: 0``: the prompt's text and, per prompt token, the
    logprob of transformers' log_softmax at the position before it (the first null);
    with ``max_tokens: 1`` (lm-evaluation-harness) the completion's token follows."""
    ids = [256, *BT.encode("echo me", bos=False), 7, 300]
    body = {"prompt": [ids, ids[:4]], "max_tokens": 0, "echo": True, "logprobs": 2}
    r = httpx.post(server + "/v1/completions", json=body, timeout=60).json()
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    for choice, n in zip(r["choices"], (len(ids), 4), strict=True):
        lp = choice["logprobs"]
        assert choice["text"] == BT.decode(ids[:n]) and choice["finish_reason"] == "length"
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == n
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for p in range(1, n):
            assert lp["token_logprobs"][p] == pytest.approx(float(ref[p - 1, ids[p]]), abs=1e-4)
            top = torch.topk(ref[p - 1], 2).values.tolist()
            assert max(lp["top_logprobs"][p].values()) == pytest.approx(top[0], abs=1e-4)
    assert r["usage"]["completion_tokens"] == 0
    one = httpx.post(
        server + "/v1/completions",
        json={"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1, "ignore_eos": True},
        timeout=60,
    ).json()["choices"][0]
    assert len(one["logprobs"]["token_logprobs"]) == len(ids) + 1
    assert one["logprobs"]["token_logprobs"][-1] == pytest.approx(
        max(one["logprobs"]["top_logprobs"][-1].values()), abs=1e-6
    )
    assert one["text"].startswith(BT.decode(ids))


def test_metrics_names_and_values(server):
    c = _client(server)
    c.completions.create(
        model="convergent-llama", prompt="m", max_tokens=3, extra_body={"ignore_eos": True}
    )
    text = httpx.get(server + "/metrics", timeout=10).text
    for name in (
        "convergent_serve_queue_length ",
        "convergent_serve_kv_used_fraction ",
        "convergent_serve_time_to_first_token_seconds_bucket",
        "convergent_serve_inter_token_latency_seconds_bucket",
        "convergent_serve_output_tokens_total ",
        'convergent_serve_requests_total{status="ok"}',
        'convergent_serve_requests_total{status="rejected"}',
    ):
        assert name in text, name
    out = [ln for ln in text.splitlines() if ln.startswith("convergent_serve_output_tokens_total ")]
    assert float(out[0].split()[1]) >= 3


def test_choice_output_holds_back_partial_utf8_and_stop_prefixes():
    from convergent.serve.output import ChoiceOutput
    from convergent.serve.scheduler import Request

    req = Request(0, [1], 64, stop_ids=frozenset({257}))
    o = ChoiceOutput(0, req, BT, ["STOP", "XY"])
    deltas = []
    for b in "héllo STwo STOP world".encode():
        d, hit = o.add(b, False, None)
        assert "\ufffd" not in d
        deltas.append(d)
        if hit:
            break
    assert "".join(deltas) == "héllo STwo " and o.finish_reason == "stop"
    # a stop token ends the choice and its text is not shown
    o2 = ChoiceOutput(0, Request(1, [1], 64, stop_ids=frozenset({ord("!")})), BT, [])
    text = "".join(o2.add(b, b == ord("!"), "stop" if b == ord("!") else None)[0] for b in b"ok!")
    assert text == "ok" and o2.finish_reason == "stop"
