"""The shared benchmark harness: interleaved order, median and spread, dirty refusal."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import _harness as h  # noqa: E402


def test_summarise_is_median_with_spread_not_best():
    s = h.summarise([5.0, 1.0, 3.0, 100.0, 2.0])
    assert s["median"] == 3.0 and s["min"] == 1.0 and s["max"] == 100.0
    assert s["q1"] == 2.0 and s["q3"] == 5.0 and s["n"] == 5


def test_interleave_runs_sides_alternately_and_discards_warmup():
    order = []

    def side(name, value):
        def run(r):
            order.append((name, r))
            return {"x": value + max(r, 0)}
        return run

    res = h.interleave("t", [h.Side("a", side("a", 10.0), {"k": 1}),
                             h.Side("b", side("b", 20.0), {"k": 1})],
                       rounds=3, warmup=1, differences=["none"], progress=False)
    assert order == [("a", -1), ("b", -1), ("a", 0), ("b", 0), ("a", 1), ("b", 1),
                     ("a", 2), ("b", 2)]
    assert [r["round"] for r in res.per_round["a"]] == [0, 1, 2]
    assert res.median("a", "x") == 11.0 and res.ratio("b", "a", "x") == 21.0 / 11.0
    d = res.to_dict()
    assert d["commit"] == res.provenance["commit"] and d["differences"] == ["none"]
    assert set(d["provenance"]) >= {"versions", "machine", "load_avg_before", "load_avg_after"}


def test_write_refuses_a_dirty_tree_unless_allowed(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.email=a@b", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "f.txt").write_text("1")
    subprocess.run([*git, "add", "f.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    (repo / "f.txt").write_text("2")
    old = h.ROOT
    h.ROOT = repo
    try:
        res = h.interleave("t", [h.Side("a", lambda r: {"x": 1.0})], rounds=1, progress=False)
        assert res.provenance["dirty"] is True
        out = tmp_path / "r.json"
        with pytest.raises(SystemExit):
            h.write_result(res, argparse.Namespace(out=str(out), allow_dirty=False))
        assert not out.exists()
        h.write_result(res, argparse.Namespace(out=str(out), allow_dirty=True))
        data = json.loads(out.read_text())
        assert data["dirty"] is True and len(data["commit"]) == 40
    finally:
        h.ROOT = old


def test_stamp_puts_commit_on_top_and_completes_the_provenance():
    prov = h.provenance()
    d = h.stamp("b", prov, {"speedup": 2.0}, differences=["peer uses 1 thread"])
    assert list(d)[:3] == ["benchmark", "commit", "dirty"] and d["commit"] == prov["commit"]
    assert d["speedup"] == 2.0 and d["differences"] == ["peer uses 1 thread"]
    assert len(d["provenance"]["load_avg_after"]) == 3 and "load_avg_after" not in prov
    s = h.spread([3.0, None, 1.0, 2.0])
    assert s["n"] == 3 and s["median"] == 2.0 and s["min"] == 1.0


def test_failed_rounds_are_kept_but_not_summarised():
    def run(r):
        return {"error": "boom"} if r == 1 else {"x": float(r)}

    res = h.interleave("t", [h.Side("a", run)], rounds=3, progress=False)
    assert [("error" in row) for row in res.per_round["a"]] == [False, True, False]
    assert "wall_s" not in res.per_round["a"][1]
    assert res.summary["a"]["x"]["n"] == 2 and res.summary["a"]["wall_s"]["n"] == 2
    assert res.median("a", "x") == 1.0


def test_a_kept_headline_key_wins_over_a_harness_field_of_its_name():
    res = h.interleave("t", [h.Side("a", lambda r: {"x": 2.0})], rounds=1, progress=False)
    res.headline.update({"summary": {"old": 1}, "speedup": 3.0})
    d = res.to_dict()
    assert d["summary"] == {"old": 1} and d["speedup"] == 3.0
    assert d["harness_summary"]["a"]["x"]["median"] == 2.0
    assert list(d)[:3] == ["benchmark", "commit", "dirty"] and "per_round" in d


def test_stamp_png_writes_the_commit_into_the_figure(tmp_path):
    from PIL import Image

    png = tmp_path / "f.png"
    Image.new("RGB", (4, 3), (10, 20, 30)).save(png)
    h.stamp_png(png, "a" * 40, "t")
    assert h.png_commit(png) == "a" * 40
    with Image.open(png) as img:
        assert img.size == (4, 3) and img.getpixel((1, 1)) == (10, 20, 30)
