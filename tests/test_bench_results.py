"""Every result and figure in bench/results is honest about where it came from: the commit it ran at
(an ancestor of this checkout when the history is there), a clean tree, and medians with
their spread rather than a best run."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = sorted((ROOT / "bench" / "results").glob("*.json"))


def _has_median_with_spread(node) -> bool:
    if isinstance(node, dict):
        if "median" in node and ({"min", "max"} <= node.keys() or {"q1", "q3"} <= node.keys()):
            return True
        return any(_has_median_with_spread(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_median_with_spread(v) for v in node)
    return False


def _history() -> bool:
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
                         capture_output=True, text=True)
    return out.returncode == 0 and out.stdout.strip() == "false"


@pytest.mark.parametrize("path", RESULTS, ids=[p.name for p in RESULTS])
def test_result_carries_its_commit_and_medians(path):
    data = json.loads(path.read_text())
    commit = data.get("commit")
    assert isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{40}", commit), f"{path.name}: no commit"
    assert data.get("dirty") is False, f"{path.name}: produced from a dirty tree"
    assert _has_median_with_spread(data), f"{path.name}: no median with its spread"
    if _history():
        anc = subprocess.run(["git", "-C", str(ROOT), "merge-base", "--is-ancestor", commit, "HEAD"])
        assert anc.returncode == 0, f"{path.name}: commit {commit[:10]} is not in this history"


FIGURES = sorted((ROOT / "bench" / "results").glob("*.png"))


@pytest.mark.parametrize("path", FIGURES, ids=[p.name for p in FIGURES])
def test_figure_names_its_commit(path):
    from PIL import Image

    with Image.open(path) as img:
        commit = img.text.get("convergent-commit")
    assert isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{40}", commit), f"{path.name}: no commit"
    if _history():
        anc = subprocess.run(["git", "-C", str(ROOT), "merge-base", "--is-ancestor", commit, "HEAD"])
        assert anc.returncode == 0, f"{path.name}: commit {commit[:10]} is not in this history"


def _first(node, key):
    """The first value of ``key`` in a depth-first walk of a result (its top provenance)."""
    if isinstance(node, dict):
        if key in node:
            return node[key]
        for v in node.values():
            found = _first(v, key)
            if found is not None:
                return found
    elif isinstance(node, list):
        for v in node:
            found = _first(v, key)
            if found is not None:
                return found
    return None


def _provenance(data):
    prov = data.get("provenance")
    return prov if isinstance(prov, dict) else _first(data, "provenance") or {}


# Results recorded before the harness wrote provenance.machine.cpu_flags (issue 36). Each is
# re-run by the harness as it is now and then leaves this list; the list only shrinks.
RECORDED_BEFORE_CPU_FLAGS = {
    "data_read.json",
}


@pytest.mark.parametrize("path", RESULTS, ids=[p.name for p in RESULTS])
def test_result_records_the_cpu_isa(path):
    flags = _provenance(json.loads(path.read_text())).get("machine", {}).get("cpu_flags")
    if path.name in RECORDED_BEFORE_CPU_FLAGS:
        assert flags is None, f"{path.name} records cpu_flags now: take it off the list"
        return
    assert isinstance(flags, dict) and {"amx_tile", "avx512_fp16", "avx512_bf16", "avx512f",
                                        "avx2"} <= flags.keys(), f"{path.name}: no cpu_flags"


def _quoted_results() -> set[str]:
    """bench/results/*.json files that the README and docs/ name (with or without the folder)."""
    text = "\n".join(t.read_text() for t in [ROOT / "README.md",
                                             *sorted((ROOT / "docs").glob("**/*.md"))])
    # the generated table of every file (bench/tables.py) lists loaded ones as such
    text = re.sub(r"<!-- results-table:start -->.*?<!-- results-table:end -->", "", text,
                  flags=re.S)
    return {p.name for p in RESULTS if re.search(rf"(?<![\w.-]){re.escape(p.name)}", text)}


@pytest.mark.parametrize("path", RESULTS, ids=[p.name for p in RESULTS])
def test_a_result_from_a_busy_machine_says_so_and_is_not_quoted(path):
    data = json.loads(path.read_text())
    prov = _provenance(data)
    # the load when the run started: the load guard's reading, taken before the bench's own
    # set-up work (data generation, warm-up); files from before the guard: the provenance's
    guard = prov.get("load_guard") or {}
    load = guard.get("load_avg_start", (prov.get("load_avg_before") or [None])[0])
    cores = prov.get("machine", {}).get("cores")
    assert isinstance(load, (int, float)) and isinstance(cores, int), f"{path.name}: no load"
    busy = load > 0.5 * cores or bool(guard.get("loaded"))
    if busy:
        assert data.get("loaded") is True, \
            f"{path.name}: load {load:.2f} on {cores} cores at the start, not marked loaded"
    if data.get("loaded"):
        assert path.name not in _quoted_results(), f"README/docs quote {path.name}, a loaded result"


def test_the_results_table_of_the_docs_is_generated_from_the_files():
    import subprocess

    from bench.lib.paths import child_env, module_argv

    done = subprocess.run([*module_argv("bench.tables"), "--check"], capture_output=True,
                          text=True, env=child_env())
    assert done.returncode == 0, done.stderr
