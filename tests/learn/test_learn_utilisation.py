"""The campaign report's utilisation: the pool's busy / available core-seconds and each
worker's (a core, or a GPU worker marked by the device its tasks ran on)."""

from __future__ import annotations

import pytest

from convergent.learn.report import build_learn_report, utilisation


def _span(kind, start, end, worker, device="cpu", session="s1", workers=3, opened=0.0):
    return {"kind": kind, "name": kind, "start": start, "end": end, "worker": worker, "pid": 1,
            "device": device, "round": 1, "ok": True, "session": session, "workers": workers,
            "opened": opened}


SPANS = [
    _span("label", 0.0, 10.0, "tcp://h:1"), _span("label", 0.0, 4.0, "tcp://h:2"),
    _span("explore", 4.0, 8.0, "tcp://h:2"),
    _span("train", 2.0, 10.0, "tcp://h:3", device="cuda"), _span("score", 0.0, 1.0, "tcp://h:3", device="cuda"),
]


def test_pool_and_per_worker_utilisation():
    u = utilisation(SPANS)
    assert u["available_core_s"] == pytest.approx(3 * 10.0)
    assert u["busy_core_s"] == pytest.approx(10 + 4 + 4 + 8 + 1)
    assert u["utilisation"] == pytest.approx(27 / 30)
    per = {w["worker"]: w for w in u["per_worker"]}
    assert [w["resource"] for w in u["per_worker"]] == ["cpu", "cpu", "gpu"]  # cores first
    assert per["tcp://h:1"]["utilisation"] == pytest.approx(1.0)
    assert per["tcp://h:2"]["utilisation"] == pytest.approx(0.8)
    assert per["tcp://h:2"]["busy_by_kind_s"] == {"label": 4.0, "explore": 4.0}
    assert per["tcp://h:3"]["utilisation"] == pytest.approx(0.9)


def test_sessions_count_apart():
    """A resumed driver's session: its own workers and window; the downtime between is not idle."""
    later = [_span("label", 100.0, 104.0, "tcp://h:9", session="s2", workers=1, opened=100.0)]
    u = utilisation(SPANS + later)
    assert u["available_core_s"] == pytest.approx(30 + 4)
    assert len(u["per_worker"]) == 4


def test_report_has_a_row_per_core_and_gpu(tmp_path):
    import json

    root = tmp_path / "learn"
    root.mkdir()
    (root / "timeline.jsonl").write_text("".join(json.dumps(s) + "\n" for s in SPANS))
    text = build_learn_report(tmp_path).read_text()
    assert "| worker | resource |" in text
    assert "| 3 | gpu |" in text and "| 1 | cpu |" in text
    assert (tmp_path / "report" / "timeline.png").stat().st_size > 0
