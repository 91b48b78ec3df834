"""`make test-gpu` (the whole default suite with CUDA visible, over pytest-xdist workers) is
ready on a machine without a GPU: it refuses in one line there, and it collects the suite."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
torch = pytest.importorskip("torch")


def _make(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "test-gpu",
                           f"GPU_PYTHON={sys.executable}", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_in_one_line_and_fails(tmp_path):
    p = _make(f"GPU_LOG={tmp_path / 'log'}", env={"CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 2
    # make's own "make: *** [...] Error 1" ("make[1]: ..." when run under make test)
    lines = [ln for ln in p.stderr.splitlines() if not re.match(r"make(\[\d+\])?: \*\*\*", ln)]
    assert lines == ["make test-gpu: no CUDA device here (torch.cuda.is_available() is False); "
                     "run make test"]
    assert not (tmp_path / "log").exists()


def test_it_collects_the_default_suite_and_the_gpu_tests_over_xdist_workers(tmp_path):
    pytest.importorskip("xdist")
    log = tmp_path / "log"
    p = _make("GPU_CHECK=0", "GPU_JOBS=2", f"GPU_LOG={log}", "GPU_PYTEST_FLAGS=",
              "PYTEST_ARGS=--collect-only -q")
    assert p.returncode == 0, p.stderr[-2000:]
    text = log.read_text()
    assert "tests/test_make_test_gpu.py::test_it_collects_the_default_suite" in text
    assert "tests/serve/test_serve_dtype.py::" in text and "tests/train/" in text
    # the gpu-marked tests are in the selection (they skip here, run there)
    assert "tests/serve/test_serve_gpu.py::" in text and "tests/train/test_train_gpu.py::" in text
    assert re.search(r"\d+ tests collected", text)


def test_where_the_cli_is_not_installed_it_puts_a_shim_on_path(tmp_path):
    """A GPU machine's image has python3 and torch but not our console script: the tests
    that run `convergent` must still find it (the first GPU run had them fail)."""
    pytest.importorskip("xdist")
    site = [p for p in sys.path if p.endswith("site-packages")]
    bindir = tmp_path / "bin"
    bindir.mkdir()
    # an interpreter outside the venv: its directory holds no `convergent`
    (bindir / "python3").symlink_to(Path(sys.executable).resolve())
    path = ":".join(p for p in os.environ["PATH"].split(":")
                    if not (Path(p) / "convergent").exists())
    log = tmp_path / "log"
    p = subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), "test-gpu", "GPU_CHECK=0",
         f"GPU_PYTHON={bindir / 'python3'}", "GPU_JOBS=0", f"GPU_LOG={log}",
         "PYTEST_ARGS=tests/test_cli.py -k test_version"],
        capture_output=True, text=True, timeout=600,
        # the packages this interpreter sees: its site-packages, and what PYTHONPATH already
        # adds (on a GPU machine the carried wheels; make adds src/ itself)
        env={**os.environ, "PATH": path,
             "PYTHONPATH": ":".join([*filter(None, os.environ.get("PYTHONPATH", "").split(":")),
                                     *site])})
    assert p.returncode == 0, log.read_text()[-3000:] if log.exists() else p.stderr[-2000:]
    assert re.search(r"test_cli.py::test_version PASSED", log.read_text())
