"""Trace generator statistics and the output-length predictors."""

from __future__ import annotations

import math

import numpy as np

from convergent.serve.predictor import (
    ConstantPredictor,
    LearnedPredictor,
    OraclePredictor,
    make_predictor,
)
from convergent.serve.workload import OUTPUT_CAP, make_trace, scale_trace, trace_stats


def test_trace_is_seeded_and_matches_lognormal_fits():
    a, b = make_trace(300, seed=3), make_trace(300, seed=3)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.prompt for r in make_trace(300, seed=4)] != [r.prompt for r in a]
    t = make_trace(4000, seed=0)
    s = trace_stats(t)
    exp = s["expected_from_fit"]
    assert abs(s["input_median"] / exp["input_median"] - 1) < 0.1
    assert abs(s["input_p90"] / exp["input_p90"] - 1) < 0.12
    assert abs(s["output_median"] / exp["output_median"] - 1) < 0.1
    assert s["output_p90"] == OUTPUT_CAP  # exp(5.83 + 1.28 * 1.01) > 1024
    assert max(r.output_len for r in t) == OUTPUT_CAP
    # log-normal shape: mean/std of log output lengths below the cap
    lo = np.log([r.output_len for r in t if r.output_len < OUTPUT_CAP])
    assert abs(np.median(np.log([r.output_len for r in t])) - 5.83) < 0.1
    assert lo.std() > 0.7
    # prompt token length (byte tokenizer + BOS) equals the recorded input length
    assert all(len(r.prompt.encode()) + 1 == r.input_len for r in t[:200])
    sc = scale_trace(t[:50], 0.25)
    assert all(
        r.output_len == max(1, round(o.output_len * 0.25)) for r, o in zip(sc, t[:50], strict=True)
    )
    sep = scale_trace(t[:50], 1.0, output_scale=0.25)  # inputs kept, outputs shrunk
    assert [r.input_len for r in sep] == [o.input_len for o in t[:50]]
    assert [r.output_len for r in sep] == [r.output_len for r in sc]
    assert math.isfinite(s["published_empirical"]["input_median"])


def test_learned_predictor_beats_constant_and_roundtrips(tmp_path):
    train, test = make_trace(2000, seed=11), make_trace(600, seed=12)
    p = LearnedPredictor().fit([r.prompt for r in train], [r.output_len for r in train])
    acc = p.accuracy([r.prompt for r in test], [r.output_len for r in test])
    const = ConstantPredictor(int(np.median([r.output_len for r in train])))
    mae_const = np.mean([abs(const.predict(r.prompt) - r.output_len) for r in test])
    assert acc["mae_tokens"] < 0.8 * mae_const
    assert acc["bucket_acc"] > 1.5 / (len(p.buckets) - 1)  # well above chance
    p.save(tmp_path / "p.json")
    q = LearnedPredictor.load(tmp_path / "p.json")
    assert [q.predict(r.prompt) for r in test[:50]] == [p.predict(r.prompt) for r in test[:50]]
    assert OraclePredictor().predict("x", 17) == 17
    assert abs(make_predictor("constant").predict("anything") - 340) < 40  # trace median
