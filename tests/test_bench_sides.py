"""The molecular benches' sides train through the one training loop (issue 38): every side
(ours, its bf16 variant, SchNet, PaiNN, MACE) is a convergent model kind trained by
train/fit.py for an equal budget of thread-CPU seconds; no bench keeps a loop of its own."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest

from bench.models.molbench import OurPotential, evaluate
from bench.models.molbench_sides import SIDES, add_training_args, fit_config, train_side
from convergent.models.mace import mace_installed
from convergent.models.schnetpack import schnetpack_installed


def _records(n: int, seed: int) -> list[dict]:
    from ase.build import molecule
    from ase.calculators.emt import EMT

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        name = ("H2O", "CH4", "NH3", "CH3OH")[i % 4]
        atoms = molecule(name)
        atoms.positions += rng.normal(0.0, 0.08, atoms.positions.shape)
        atoms.calc = EMT()
        out.append({"key": f"{name}/{i}", "molecule_id": name, "numbers": atoms.numbers.astype(np.int64),
                    "positions": atoms.positions.copy(), "energy": float(atoms.get_potential_energy()),
                    "forces": atoms.get_forces().copy()})
    return out


def _args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_training_args(ap)
    return ap.parse_args(["--hidden", "16", "--layers", "2", "--mace-channels", "8", *argv])


def test_every_side_is_one_config_of_the_one_loop_with_a_thread_cpu_budget():
    args = _args("--budget", "7.5", "--lr", "2e-3", "--ema", "0.9")
    for name in SIDES:
        cfg = fit_config(name, args, "/data", seed=3)
        t = cfg.train
        assert (t.time_budget_s, t.budget_clock, t.threads, t.prefetch) == (7.5, "thread_cpu", 1, 0)
        assert (t.lr, t.ema_decay, t.seed, t.grad_clip) == (2e-3, 0.9, 3, 10.0)
        assert cfg.precision.dtype == ("bf16" if name == "ours_bf16" else "fp32")
        kind = "molecular" if name.startswith("ours") else name
        assert cfg.model.kind == kind, name


@pytest.mark.parametrize("name", [
    "ours",
    pytest.param("schnet", marks=pytest.mark.skipif(not schnetpack_installed(), reason="no schnetpack")),
    pytest.param("mace", marks=pytest.mark.skipif(not mace_installed(), reason="no mace-torch")),
])
def test_a_side_trains_for_its_budget_and_beats_its_untrained_self(name):
    train, test = _records(24, 0), _records(8, 1)
    args = _args("--budget", "2.0", "--lr", "1e-2", "--ema", "0")
    pot, n_params, model_cfg, info = train_side(name, args, train, seed=0)
    assert isinstance(pot, OurPotential) and n_params > 0
    assert model_cfg.kind == ("molecular" if name == "ours" else name)
    assert info["steps"] > 0 and info["budget_thread_cpu_seconds"] >= 2.0
    assert info["diverged_at_step"] is None
    after = evaluate(pot, test)
    assert math.isfinite(after["energy_mae"]) and math.isfinite(after["force_mae"])
    # the same side, one optimizer step: training for the budget moved it further
    short = _args("--budget", "1e-6", "--lr", "1e-2", "--ema", "0")
    pot0, _, _, info0 = train_side(name, short, train, seed=0)
    assert info0["steps"] == 1
    assert after["force_mae"] < evaluate(pot0, test)["force_mae"]
