"""A time budget as an option of the one training loop (train/budget.py): the run stops
after the step at which ``train.time_budget_s`` of its clock are spent (``steps`` is a
cap), the cosine schedule runs over the budget's fraction, and an equal-time comparison
(the benches' sides) trains through train/fit.py like every other run."""

from __future__ import annotations

import json
import math

import pytest

from convergent.config import ConvergentConfig
from convergent.train.budget import TimeBudget
from convergent.train.fit import fit
from convergent.train.runtime import lr_lambda
from tests.train.moldataset import make_dataset


def _cfg(data, **train):  # noqa: ANN001, ANN003
    base = {"dataset": str(data), "steps": 100_000, "lr": 1e-3, "batch_atoms": 128,
            "warmup_steps": 2, "threads": 1, "device": "cpu", "val_every": 0, "prefetch": 0,
            "min_lr_ratio": 0.0}
    return ConvergentConfig.model_validate({
        "model": {"hidden": 16, "layers": 2, "heads": 2}, "train": {**base, **train},
        "checkpoint": {"interval": 0, "keep": 1, "resume": False, "at_end": False},
        "metrics": {"tensorboard": False, "mfu": False}})


@pytest.mark.parametrize("clock", ["thread_cpu", "process_cpu", "wall"])
def test_a_budget_stops_the_run_after_the_step_that_spends_it(tmp_path, clock):
    data, _ = make_dataset(tmp_path / "data", n_train=24, n_val=8)
    summary = fit(_cfg(data, time_budget_s=0.6, budget_clock=clock), tmp_path / "run")
    assert 0 < summary["steps"] < 100_000  # the cap was not what stopped it
    assert summary["budget"]["clock"] == clock
    assert summary["budget"]["elapsed"] >= 0.6
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r.get("kind") == "train_step"]
    assert [r["step"] for r in steps] == list(range(1, summary["steps"] + 1))
    lrs = [r["lr"] for r in steps[2:]]  # after the warm-up: cosine over the budget, falling
    assert all(b <= a for a, b in zip(lrs, lrs[1:], strict=False)), lrs


def test_the_schedule_follows_the_fraction_of_the_budget_spent():
    cfg = ConvergentConfig.model_validate({"train": {"time_budget_s": 10.0, "warmup_steps": 3,
                                                     "min_lr_ratio": 0.1, "steps": 50}})
    budget = TimeBudget(10.0, "wall")
    f = lr_lambda(cfg, budget)
    assert f(0) == pytest.approx(1 / 3)  # warm-up is in steps
    for frac in (0.0, 0.25, 0.5, 1.0, 1.7):
        budget.fraction = frac
        want = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
        assert f(40) == pytest.approx(want)  # the step count no longer matters
    no_budget = lr_lambda(cfg, TimeBudget(None))
    assert no_budget(3 + 47) == pytest.approx(0.1)  # without one, the steps decide


def test_time_spent_before_a_resume_counts():
    b = TimeBudget(5.0, "wall")
    b.start(spent_before=4.0)
    assert b.elapsed() >= 4.0
    b.fraction = 0.99
    assert not b.spent
    b.update(device=None)  # one process: no collective
    assert b.fraction >= 0.8
    assert TimeBudget(None).spent is False
