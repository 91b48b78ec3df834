"""Serving's typed boundaries: the one layer split of train and serve, the messages between
engine, executor and stages, one sampling-parameters object from the protocol model to
the sampler, the request status, the restart budget, and the small engine interface the
HTTP layer is held to."""

from __future__ import annotations

import ast
import json
import pickle
from dataclasses import asdict
from pathlib import Path

import pytest

from convergent.core.errors import ConfigError
from convergent.models.layersplit import split_layers, stage_layers
from convergent.serve.config import EngineConfig, FaultsConfig, ServeConfig
from convergent.serve.messages import (
    BatchMeta,
    BatchResult,
    Heartbeat,
    RendezvousPort,
    Sampled,
    StageBusy,
    StageError,
    StageReady,
    StopStage,
    TokenEvent,
)
from convergent.serve.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from convergent.serve.restarts import RestartBudget
from convergent.serve.sampling import SEED_STRIDE, RowParams, SamplingParams, TokenLogprobs
from convergent.serve.scheduler_base import Request, RequestStatus

SERVE = Path(__file__).resolve().parents[2] / "src" / "convergent" / "serve"


def test_one_layer_split_for_train_and_serve():
    pytest.importorskip("torch")  # train.taskapi imports it
    from convergent.serve import stage
    from convergent.train.taskapi import stage_layers as train_stage_layers

    assert [len(r) for r in split_layers(10, 4)] == [3, 3, 2, 2]
    assert stage.split_layers is split_layers
    for n in range(1, 13):
        for p in range(1, n + 1):
            parts = split_layers(n, p)
            assert [i for r in parts for i in r] == list(range(n))  # contiguous, all
            sizes = [len(r) for r in parts]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
            assert parts == [train_stage_layers(n, s, p) for s in range(p)]
    with pytest.raises(ConfigError, match="model.layers=4"):
        train_stage_layers(4, 0, 5)
    with pytest.raises(ConfigError, match="at least one layer per stage"):
        stage_layers(2, 0, 3)


def test_messages_are_records_that_pickle():
    rows = RowParams()
    rows.add(SamplingParams(temperature=0.5, top_k=3, top_p=0.9, seed=11, logprobs=2), 17)
    assert rows == RowParams([0.5], [11 * SEED_STRIDE + 17], [3], [0.9], [2])
    lp = TokenLogprobs(-0.25, {5: -0.25, 9: -1.5})
    msgs = [
        BatchMeta(3, [1, 2], [0, 1], [0, 1], [2], [2], [[0]], [1], [7], rows),
        BatchResult(3, Sampled({7: 5}, {7: lp}), 1.0, 2.0),
        StageBusy(0, 3, 0.5, 1.0),
        StageReady(1, 4096),
        StageError(1, "Traceback ...\nRuntimeError: boom"),
        Heartbeat(2),
        RendezvousPort(29500),
        StopStage(),
        TokenEvent(7, 5, True, "stop"),
    ]
    for m in msgs:
        assert pickle.loads(pickle.dumps(m)) == m
        assert not isinstance(m, tuple)
    assert list(msgs[1].sampled.logprobs[7].top) == [5, 9]  # likeliest first


def _parse(kind, **body):
    return parse_request(json.dumps(body).encode(), kind)


def test_protocol_model_gives_the_sampling_params():
    c = _parse(CompletionRequest, prompt="a", temperature=0.5, top_k=-1, seed=7, logprobs=2)
    assert c.sampling_params(1) == SamplingParams(0.5, 0, 1.0, 8, 2)
    c = _parse(CompletionRequest, prompt="a", top_k=4, top_p=0.5, seed=1)
    assert c.sampling_params(0) == SamplingParams(0.0, 4, 0.5, 1, -1)
    msgs = [{"role": "user", "content": "x"}]
    ch = _parse(ChatCompletionRequest, messages=msgs, logprobs=True)
    assert ch.sampling_params().logprobs == 0
    ch = _parse(ChatCompletionRequest, messages=msgs, logprobs=True, top_logprobs=3)
    assert ch.sampling_params().logprobs == 3
    drawn = _parse(ChatCompletionRequest, messages=msgs).sampling_params()
    assert drawn.logprobs == -1 and 0 <= drawn.seed < 2**31


def test_request_status_stays_a_string():
    r = Request(0, [1], 4)
    assert r.state is RequestStatus.WAITING and r.state == "waiting" and not r.finished
    r.state = RequestStatus.FINISHED
    assert r.finished and r.state == "finished"
    assert json.dumps({"state": r.state}) == '{"state": "finished"}'
    assert f"{r.state}" == "finished"


def test_restart_budget():
    cfg = FaultsConfig(max_restarts=2)
    b = RestartBudget(window_s=600.0)
    b.record(0.0)
    b.record(1.0)
    assert b.allows(cfg)
    b.record(2.0)
    assert not b.allows(cfg) and "3 failure(s) in 600 s" in b.refusal(cfg)
    b.record(700.0)  # the three earlier ones are out of the window
    assert b.recent == 1 and b.allows(cfg)
    assert not b.allows(FaultsConfig(restart_on_failure=False))


HTTP_LAYER = ("api.py", "api_requests.py", "api_stream.py", "server.py")
ENGINE_INTERNALS = {"bm", "mcfg", "sched", "executor", "last_loop", "in_flight", "stats"}


def test_http_layer_uses_only_the_engine_interface():
    """No reaching into the engine's block manager, model config or scheduler, no private
    attributes, and no callbacks assigned as attributes."""
    bad = []
    for name in HTTP_LAYER:
        tree = ast.parse((SERVE / name).read_text())
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and getattr(t.value, "id", "") == "engine":
                    bad.append(f"{name}:{node.lineno}: assigns engine.{t.attr}")
            if isinstance(node, ast.Attribute) and getattr(node.value, "id", "") == "engine":
                if node.attr in ENGINE_INTERNALS or node.attr.startswith("_"):
                    bad.append(f"{name}:{node.lineno}: engine.{node.attr}")
    assert not bad, bad


def test_local_executor_reports_typed_results(hf_llama_dir):
    """Two in-process stages: a busy record of stage 0, then the last stage's sampled
    token (greedy: the likeliest of its top logprobs) as a BatchResult."""
    pytest.importorskip("torch")
    from convergent.serve.executor import LocalExecutor
    from convergent.serve.stage import StageSpec

    engine = EngineConfig(block_size=4)
    specs = [StageSpec(str(hf_llama_dir), s, 2, num_blocks=4, engine=engine) for s in range(2)]
    ex = LocalExecutor(specs)
    rows = RowParams()
    rows.add(SamplingParams(logprobs=2), 4)
    ids = [0, 1, 2, 3]
    ex.submit(BatchMeta(0, [256, 1, 2, 3], ids, ids, [4], [4], [[0]], [3], [7], rows))
    busy, res = ex.poll(timeout=0.0)
    assert isinstance(busy, StageBusy) and (busy.stage, busy.bid) == (0, 0)
    assert isinstance(res, BatchResult) and res.bid == 0 and busy.t1 <= res.t0 <= res.t1
    tok = res.sampled.tokens[7]
    lp = res.sampled.logprobs[7]
    assert list(lp.top)[0] == tok and lp.logprob == pytest.approx(lp.top[tok])
    ex.close()


def test_engine_snapshots_keep_the_json_keys(hf_llama_dir):
    pytest.importorskip("torch")
    from convergent.serve.engine import Engine

    cfg = ServeConfig(
        engine={"kv_budget_bytes": 262144},
        scheduler={"kind": "sequential", "profile_costs": False},
    )
    with Engine(hf_llama_dir, cfg, ignore_eos=True) as eng:
        assert eng.vocab_size == 320
        kv = eng.kv_usage()
        assert kv.used == 0 and kv.blocks > 0 and kv.fraction == 0.0
        assert list(asdict(eng.load())) == [
            "healthy",
            "waiting",
            "running",
            "queued_tokens",
            "kv_used_fraction",
        ]
        assert list(asdict(eng.serving_stats())) == [
            "scheduler",
            "num_stages",
            "kv_blocks",
            "kv_used_blocks",
            "kv_peak_blocks",
            "kv_budget_bytes",
            "kv_allocated_bytes",
            "context_limit",
            "preemptions",
            "restarts",
            "last_failure",
        ]
        events = []
        eng.add_token_listener(events.append)
        r = eng.add_request(eng.make_request([256, 1, 2], 3))
        eng.run()
    assert [e.token for e in events] == r.output and r.state == RequestStatus.FINISHED
    assert events[-1].finished and events[-1].finish_reason == "length"
