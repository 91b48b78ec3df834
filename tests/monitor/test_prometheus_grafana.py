"""A real Prometheus scrapes a short training run and a `convergent serve` instance with the
shipped scrape config; every expected series exists and every panel query of the shipped
Grafana dashboard returns data (through Prometheus' HTTP API, as Grafana would ask)."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.cli_exe import EXE

ROOT = Path(__file__).resolve().parents[2]
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "convergent.json"

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"

TRAIN_SERIES = [
    "convergent_train_step_data_wait_s", "convergent_train_step_compute_s",
    "convergent_train_step_comm_s", "convergent_train_step_optimizer_s",
    "convergent_train_step_step_s", "convergent_train_step_mfu",
    "convergent_train_step_samples_per_s", "convergent_train_step_loss",
]
SERVE_SERIES = [
    "convergent_serve_queue_length", "convergent_serve_kv_used_fraction",
    "convergent_serve_time_to_first_token_seconds_bucket",
    "convergent_serve_inter_token_latency_seconds_bucket",
    "convergent_serve_output_tokens_total", "convergent_serve_requests_total",
]

pytestmark = pytest.mark.skipif(
    not os.access(PROMETHEUS, os.X_OK),
    reason="the prometheus server is not installed (Debian package 'prometheus', "
    "scripts/system-deps.sh installs it)",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(pred, what: str, timeout: float = 120.0, proc: subprocess.Popen | None = None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.25)
    raise AssertionError(f"gave up waiting for {what}")


class Prom:
    """A Prometheus server on 127.0.0.1 with the shipped config pointed at our targets."""

    def __init__(self, tmp: Path, train_port: int, serve_port: int) -> None:
        cfg = yaml.safe_load(SCRAPE_CONFIG.read_text())
        cfg["global"].update(scrape_interval="500ms", scrape_timeout="500ms")
        targets = {"convergent-train": train_port, "convergent-serve": serve_port}
        for job in cfg["scrape_configs"]:
            for sc in job["static_configs"]:
                sc["targets"] = [f"127.0.0.1:{targets[job['job_name']]}"]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = (tmp / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        self.start = time.time()
        _wait(self._ready, "prometheus to be ready", proc=self.proc)

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.base}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def api(self, path: str, **params) -> list:
        r = httpx.get(f"{self.base}/api/v1/{path}", params=params, timeout=30)
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]["result"] if isinstance(body["data"], dict) else body["data"]

    def series(self, name: str) -> list:
        return self.api("series", **{"match[]": name, "start": self.start - 60,
                                     "end": time.time() + 1})

    def query_range(self, expr: str) -> list:
        return self.api("query_range", query=expr, start=self.start - 5, end=time.time() + 1,
                        step="1s")

    def up(self, job: str) -> bool:
        return any(v["value"][1] == "1" for v in self.api("query", query=f'up{{job="{job}"}}'))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture
def prom(tmp_path):
    train_port, serve_port = _free_port(), _free_port()
    p = Prom(tmp_path, train_port, serve_port)
    p.train_port, p.serve_port = train_port, serve_port
    yield p
    p.close()


def _panel_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            # Grafana's rate window variable; 5 s spans 10 scrapes at the test's interval
            out.append((panel["title"], t["expr"].replace("$__rate_interval", "5s")))
    return out


def _has_data(result: list) -> bool:
    return any(math.isfinite(float(v)) for s in result for _, v in s.get("values", []))


def _train(tmp: Path, port: int) -> subprocess.CompletedProcess:
    from tests.train.moldataset import make_dataset

    train, val = make_dataset(tmp / "data", n_train=48, n_val=8)
    sets = [f"train.dataset={train}", f"train.val_dataset={val}", "model.hidden=32",
            "model.layers=2", "model.heads=4", "train.steps=120", "train.global_batch_atoms=96",
            "train.val_every=0", "checkpoint.interval=1000", "metrics.tensorboard=false",
            f"metrics.prometheus_port={port}"]
    cmd = [EXE, "train", "--nproc", "2", "--run-dir", str(tmp / "run")]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_training_series_and_panels(prom, tmp_path):
    out = _train(tmp_path, prom.train_port)
    assert out.returncode == 0, out.stderr[-3000:]
    for name in TRAIN_SERIES:
        assert prom.series(name), f"no series {name} scraped from the training run"
    for title, expr in _panel_queries():
        if "convergent_train" in expr:
            assert _has_data(prom.query_range(expr)), f"panel '{title}': {expr} returned no data"


def test_serving_series_and_panels(prom, tmp_path):
    port = prom.serve_port
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [EXE, "serve", "--port", str(port), "--set", f"run.root={tmp_path}"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            try:
                return httpx.get(f"{base}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        _wait(healthy, "convergent serve to be healthy", timeout=240, proc=proc)
        exposed = httpx.get(f"{base}/metrics", timeout=10)
        assert exposed.status_code == 200, f"convergent serve has no GET /metrics ({exposed.status_code})"
        _wait(lambda: prom.up("convergent-serve"), "prometheus to scrape the server")
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        for i in range(6):
            r = httpx.post(f"{base}/v1/completions", timeout=120, json={
                "model": model, "prompt": f"hello {i}", "max_tokens": 12, "ignore_eos": True})
            assert r.status_code == 200, r.text
        time.sleep(2)  # a few more scrapes after the requests (not a timing assertion)
        for name in SERVE_SERIES:
            assert prom.series(name), f"no series {name} scraped from convergent serve"
        for title, expr in _panel_queries():
            if "convergent_serve" in expr:
                assert _has_data(prom.query_range(expr)), f"panel '{title}': {expr} returned no data"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def test_every_panel_is_covered():
    exprs = [e for _, e in _panel_queries()]
    assert exprs and all("convergent_train" in e or "convergent_serve" in e for e in exprs)
