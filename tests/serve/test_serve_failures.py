"""Stage processes killed mid-stream, restarts, heartbeats and graceful SIGTERM, on a real
`convergent serve` (3 pipeline stages) driven by the official openai client."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

from tests.serve.servers import stage_pids, start_server, stop_server, wait_health  # noqa: E402

COMMON = (
    "serve.scheduler.kind=interleaved",
    "serve.scheduler.stages=3",
    "serve.engine.kv_budget_bytes=262144",
    "serve.engine.block_size=4",
    "serve.engine.max_model_len=256",
)


def _client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)


def _streams_then(base, action, n=3, max_tokens=240):
    """Open ``n`` streams; once each has a token, run ``action``; returns per stream
    ``(text, exception or None, seconds from action to the stream's end)``."""
    started = threading.Barrier(n + 1)
    fired = {}
    out = [None] * n

    def one(i):
        text, exc, got_first = "", None, False
        try:
            s = _client(base).completions.create(
                model="convergent-llama",
                prompt=f"s{i}",
                max_tokens=max_tokens,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for ch in s:
                text += ch.choices[0].text if ch.choices else ""
                if not got_first:
                    got_first = True
                    started.wait(timeout=120)
        except Exception as e:  # noqa: BLE001 - what the client raised is the result
            exc = e
        if not got_first:
            started.wait(timeout=120)
        out[i] = (text, exc, time.monotonic() - fired.get("t", time.monotonic()))

    ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    started.wait(timeout=120)
    fired["t"] = time.monotonic()
    action()
    for t in ts:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in ts), "a stream hung"
    return out


@pytest.fixture(scope="module")
def pipeline_server(hf_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fail")
    proc, base = start_server(hf_llama_dir, root, *COMMON, "serve.faults.heartbeat_timeout_s=5")
    yield proc, base
    stop_server(proc)


@pytest.mark.parametrize("stage", [2, 0, 1], ids=["last", "first", "middle"])
def test_killed_stage_fails_streams_then_restarts(pipeline_server, stage):
    proc, base = pipeline_server
    ref = _client(base).completions.create(
        model="convergent-llama", prompt="ref", max_tokens=8, extra_body={"ignore_eos": True}
    )
    pids = stage_pids(proc.pid)
    assert len(pids) == 3
    victim = pids[stage]
    seen = []  # /health answers from the kill until the pipeline is back
    stop = threading.Event()

    def watch():
        with httpx.Client(timeout=5) as h:
            while not stop.is_set():
                r = h.get(base + "/health")
                seen.append((r.status_code, r.json()))
                time.sleep(0.05)

    def kill():
        os.kill(victim, signal.SIGKILL)
        threading.Thread(target=watch, daemon=True).start()

    results = _streams_then(base, kill)
    for text, exc, took in results:
        assert isinstance(exc, openai.APIError), (text, exc)
        assert f"stage {stage}" in str(exc) and "SIGKILL" in str(exc)
        assert took < 60
    # unhealthy until the pipeline is back, then it serves the same tokens again
    health = wait_health(base, timeout=120)
    time.sleep(0.2)
    stop.set()
    bad = [body for code, body in seen if code == 503]
    assert bad and all(b["status"] == "unhealthy" and f"stage {stage}" in b["reason"] for b in bad)
    assert seen[-1][0] == 200
    assert health["restarts"] >= 1
    assert victim not in stage_pids(proc.pid)
    again = _client(base).completions.create(
        model="convergent-llama", prompt="ref", max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert again.choices[0].text == ref.choices[0].text
    metrics = httpx.get(base + "/metrics", timeout=5).text
    assert 'convergent_serve_requests_total{status="error"}' in metrics


def test_no_restart_heartbeat_timeout_exits_nonzero(hf_llama_dir, tmp_path):
    """A frozen (SIGSTOPped) stage is caught by the heartbeat; without restarts the
    in-flight requests end with the reason and the server exits non-zero."""
    proc, base = start_server(
        hf_llama_dir,
        tmp_path,
        *COMMON,
        "serve.faults.restart_on_failure=false",
        "serve.faults.heartbeat_timeout_s=2",
    )
    try:
        victim = stage_pids(proc.pid)[1]
        results = _streams_then(base, lambda: os.kill(victim, signal.SIGSTOP), n=2)
        for _text, exc, _took in results:
            assert isinstance(exc, openai.APIError) and "heartbeat" in str(exc)
        assert proc.wait(timeout=60) != 0
        assert "no restart" in proc.log_path.read_text()
    finally:
        stop_server(proc)


def test_sigterm_with_streams_in_flight_exits_cleanly(hf_llama_dir, tmp_path):
    proc, base = start_server(hf_llama_dir, tmp_path, *COMMON, "serve.http.shutdown_timeout_s=1")
    stages = stage_pids(proc.pid)
    try:
        results = _streams_then(base, lambda: proc.send_signal(signal.SIGTERM), max_tokens=240)
        assert proc.wait(timeout=60) == 0
    finally:
        stop_server(proc)
    for text, exc, _took in results:  # each stream ended: complete, or with the reason
        assert exc is None or "shutting down" in str(exc), (text, exc)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in stages)


def _engine_with_a_queue(hf_llama_dir, restart: bool):
    """In-process engine, 2 stage processes, one sequence per micro-batch: of 5 requests
    the first two run (long outputs) and three wait in the queue when stage 1 is killed
    (after the first token). Returns the requests once each has ended, the queued ones and
    the engine (closed)."""
    from convergent.serve.config import ServeConfig
    from convergent.serve.engine import Engine

    cfg = ServeConfig(
        engine={"block_size": 4, "kv_budget_bytes": 2**20},
        scheduler={"kind": "interleaved", "stages": 2, "max_num_seqs": 1, "profile_costs": False},
        faults={"heartbeat_timeout_s": 5, "restart_on_failure": restart},
    )
    done, first = threading.Event(), threading.Event()
    with Engine(hf_llama_dir, cfg, ignore_eos=True) as eng:
        reqs = [eng.make_request([256, 1, 2, i], 200 if i < 2 else 30) for i in range(5)]
        for r in reqs:  # before the loop starts: its first step admits the first two
            eng.add_request(r)
        ended = []

        def on_token(ev):
            if ev.token >= 0:
                first.set()
            if ev.finished:
                ended.append(ev.rid)
                if len(ended) == len(reqs):
                    done.set()

        eng.add_token_listener(on_token)
        eng.start()
        assert first.wait(60)
        queued = [r for r in reqs if r.state == "waiting"]
        eng.executor.procs[1].kill()
        assert done.wait(120)
    return reqs, queued, eng


def test_queued_requests_survive_a_stage_restart(hf_llama_dir, hf_greedy):
    """A stage dies: the requests running in the stages end with the reason (not
    retryable), the ones still queued stay queued and run on the restarted pipeline,
    token for token as transformers decodes them."""
    reqs, queued, eng = _engine_with_a_queue(hf_llama_dir, restart=True)
    assert len(queued) == 3 and eng.restarts == 1
    failed = [r for r in reqs if r.finish_reason == "error"]
    assert failed and all("stage 1" in r.error and not r.retryable for r in failed)
    assert all(r not in queued for r in failed)
    ref = hf_greedy(hf_llama_dir, [r.prompt for r in queued], 30)
    assert [r.output for r in queued] == ref
    assert all(r.finish_reason == "length" for r in queued)


def test_queued_requests_end_retryable_without_a_restart(hf_llama_dir):
    """Without a restart the queue ends too, marked retryable (the API answers code
    ``not_started``, which the dispatcher routes again)."""
    reqs, queued, eng = _engine_with_a_queue(hf_llama_dir, restart=False)
    assert len(queued) == 3 and eng.restarts == 0 and eng.error is not None
    assert all(r.finish_reason == "error" and "stage 1" in r.error for r in reqs)
    assert all(r.retryable and not r.output for r in queued)
    assert not any(r.retryable for r in reqs if r.output)
