"""Helpers of the serving tests: a real `convergent serve` process on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from convergent.serve.executor import free_port


def start_server(model_dir, run_root, *sets: str, instances: int | None = None, key=None):
    """Start `convergent serve`; returns ``(proc, base_url)`` once /health answers 200."""
    port = free_port()
    cmd = [
        sys.executable,
        "-c",
        "from convergent.cli import entry; entry()",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--set",
        f"run.root={run_root}",
    ]
    if instances is not None:  # a dispatcher in front
        cmd += ["--instances", str(instances)]
    if key:
        cmd += ["--api-key", key]
    for s in sets:
        cmd += ["--set", s]
    log = open(run_root / f"server-{port}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    proc.log_path = run_root / f"server-{port}.log"
    base = f"http://127.0.0.1:{port}"
    wait_health(base, proc)
    if instances is not None:  # every instance up, not just one
        deadline = time.monotonic() + 240
        while not all(i["healthy"] for i in httpx.get(base + "/instances", timeout=5).json()):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"instances did not start: {proc.log_path.read_text()[-3000:]}")
            time.sleep(0.2)
    return proc, base


def wait_health(base, proc=None, timeout: float = 240.0, status: int = 200) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.log_path.read_text()[-3000:]}")
        try:
            r = httpx.get(base + "/health", timeout=2)
            if r.status_code == status:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"/health did not answer {status} in {timeout} s")


def stop_server(proc) -> int:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def stage_pids(server_pid: int) -> list[int]:
    """The stage processes (multiprocessing children) of a server, oldest first."""
    import psutil

    kids = psutil.Process(server_pid).children(recursive=True)
    stages = [
        k
        for k in kids
        if "multiprocessing" in " ".join(k.cmdline())
        and "resource_tracker" not in " ".join(k.cmdline())
    ]
    return [k.pid for k in sorted(stages, key=lambda k: k.create_time())]
