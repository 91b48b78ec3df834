"""The data-read benchmark (bench/dataio/read.py) runs end to end at a tiny scale (slow:
excluded by default): loose files, our shards through the reference streaming reader and
through open_dataset's random access (the trainer's access), all in the same order."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.lib.paths import child_env, module_argv


@pytest.mark.slow
def test_data_read_bench_tiny(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [*module_argv("bench.dataio.read"), "--records", "2000", "--systems", "loose,convergent,convergent_random",
         "--data-dir", str(tmp_path / "d"), "--out", str(out), "--no-strace", "--workers", "1", "--repeats", "1",
         "--peer-python", sys.executable, "--allow-dirty"],
        capture_output=True, text=True, timeout=900, env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["headline"] == "cold" and set(rep["results"]) == {"cold", "warm"}
    for mode in ("cold", "warm"):
        for s in ("loose", "convergent", "convergent_random"):
            r = rep["results"][mode][s]
            assert r["samples"] == 2000 and r["bytes"] == rep["results"]["cold"]["loose"]["bytes"]
        assert rep["summary"][mode]["convergent_vs_loose"] > 0
        assert rep["summary"][mode]["convergent_random_vs_convergent"] > 0
        # equal shuffle semantics: the loose files and the random-access side are read in
        # ours' order, record for record
        assert rep["summary"][mode]["loose_same_order_as_convergent"] is True
        assert rep["summary"][mode]["convergent_random_same_order_as_convergent"] is True
    # the eviction worked: nothing of the data was in the page cache before a cold read,
    # and the warm read found what the cold read had just brought in
    for s in ("loose", "convergent", "convergent_random"):
        assert rep["results"]["cold"][s]["resident_before"] < 0.05
        assert rep["results"]["warm"][s]["resident_before"] > 0.5
    assert rep["versions"]["ours"]["torch"] and rep["machine"]["usable_cpus"] >= 1
    # the harness discipline: the commit on top, the settings of each side, load before/after
    assert len(rep["commit"]) == 40 and rep["settings"]["loose"]["shuffle"].startswith("same")
    assert any("not the trainer's reader" in d for d in rep["differences"])
    assert len(rep["provenance"]["load_avg_after"]) == 3
