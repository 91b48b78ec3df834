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
