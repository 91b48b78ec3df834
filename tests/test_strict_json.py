"""Issue 37: every JSON the project writes is strict (no NaN/Infinity; null + reason)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from convergent.core.fsutil import dumps_json, loads_strict

SRC = Path(__file__).resolve().parents[1] / "src" / "convergent"
# json.dumps kept only where the text is hashed, never written
HASHED = {"sim/relabel.py", "sim/campaign.py", "sim/resume.py", "data/textcorpus.py",
          "data/mds.py", "serve/tokenizer.py"}


def test_non_finite_numbers_become_null_with_a_reason():
    text = dumps_json({"mae": float("nan"), "top": np.float64("inf"), "ok": 1.5,
                       "rows": [1.0, float("-inf")], "inner": {"std": math.nan}},
                      reasons={"mae": "no labels"})
    d = loads_strict(text)
    assert d["mae"] is None and d["mae_null_reason"] == "no labels"
    assert d["top"] is None and d["top_null_reason"] == "infinite"
    assert d["rows"] == [1.0, None] and d["ok"] == 1.5
    assert d["inner"] == {"std": None, "std_null_reason": "not a number (NaN)"}
    with pytest.raises(ValueError):
        loads_strict(json.dumps({"x": float("nan")}))
    with pytest.raises(ValueError):  # a miss fails loudly, not as NaN
        dumps_json({"x": object()}, default=lambda o: float("nan"))


def test_no_module_writes_json_through_plain_json_dumps():
    plain = []
    for p in SRC.rglob("*.py"):
        rel = p.relative_to(SRC).as_posix()
        if rel != "core/fsutil.py" and rel not in HASHED and re.search(r"\bjson\.dumps?\(", p.read_text()):
            plain.append(rel)
    assert not plain, f"use fsutil.dumps_json in {plain}"
