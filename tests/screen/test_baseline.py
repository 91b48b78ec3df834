"""The per-element linear baseline: exact on linear data, fitted on a real dataset store."""

from __future__ import annotations

import numpy as np
import pytest

from convergent.core.errors import InputError
from convergent.data.writer import write_records
from convergent.screen.baseline import fit_element_baseline, fit_on_dataset

REFS = {1: -13.6, 6: -1030.0, 7: -1485.5, 8: -2040.25}


def _synthetic(n: int, seed: int = 0, noise: float = 0.0):
    rng = np.random.default_rng(seed)
    numbers, energies = [], []
    for _ in range(n):
        z = rng.choice(list(REFS), size=int(rng.integers(2, 12)))
        numbers.append(z)
        energies.append(sum(REFS[int(k)] for k in z) + noise * rng.standard_normal())
    return numbers, energies


def test_fit_recovers_exact_references_on_linear_data():
    numbers, energies = _synthetic(40)
    base = fit_element_baseline(numbers, energies)
    assert set(base.energies) == set(REFS) and base.structures == 40
    for z, e in REFS.items():
        assert base.energies[z] == pytest.approx(e, abs=1e-8)
    held, held_e = _synthetic(10, seed=1)
    assert np.allclose(base.predict(held), held_e, atol=1e-7)


def test_unlabelled_structures_are_skipped_and_unseen_elements_give_nan():
    numbers, energies = _synthetic(30)
    energies[3] = float("nan")  # an unlabelled frame does not poison the fit
    base = fit_element_baseline(numbers, energies)
    assert base.structures == 29 and base.energies[8] == pytest.approx(REFS[8], abs=1e-8)
    pred = base.predict([np.array([6, 1, 1]), np.array([6, 16])])  # S never seen
    assert pred[0] == pytest.approx(REFS[6] + 2 * REFS[1]) and np.isnan(pred[1])


def test_noisy_fit_is_the_least_squares_solution():
    numbers, energies = _synthetic(50, noise=0.3)
    base = fit_element_baseline(numbers, energies)
    cols = sorted(REFS)
    a = np.array([[np.sum(z == k) for k in cols] for z in numbers], float)
    ref, *_ = np.linalg.lstsq(a, np.array(energies), rcond=None)
    assert [base.energies[k] for k in cols] == pytest.approx(ref.tolist(), abs=1e-9)


def test_bad_inputs_are_refused():
    with pytest.raises(InputError, match="no labelled structure"):
        fit_element_baseline([np.array([1, 1])], [float("nan")])
    with pytest.raises(InputError, match="2 structures but 1 energies"):
        fit_element_baseline([np.array([1]), np.array([8])], [1.0])


def test_fit_on_a_dataset_store(tmp_path):
    numbers, energies = _synthetic(12)
    recs = [{"key": f"s{i}", "molecule_id": f"m{i}", "numbers": z,
             "positions": np.random.default_rng(i).normal(size=(len(z), 3)) * 2, "energy": e}
            for i, (z, e) in enumerate(zip(numbers, energies, strict=True))]
    write_records(tmp_path / "ds", recs)
    base = fit_on_dataset(tmp_path / "ds")
    assert base.structures == 12
    assert base.energies[7] == pytest.approx(REFS[7], abs=1e-6)
