"""``train.reference_fit``: the trainer's model carries the element references it asks for."""

from __future__ import annotations

import numpy as np
import pytest

from convergent.config import load_config
from convergent.models.molecular import fit_reference_energies
from convergent.train.moldata import MoleculeSource, build


@pytest.mark.parametrize("kind", ["per_element", "per_atom"])
def test_reference_fit_reaches_the_model(moldata, kind):
    train, _ = moldata
    cfg = load_config(None, [f"train.dataset={train}", "model.hidden=16", "model.layers=1",
                             f"train.reference_fit={kind}"])
    source = MoleculeSource(train, cfg.data)
    model = build(cfg, source)
    recs = [source.record(i) for i in range(len(source))]
    want = fit_reference_energies(recs, per_element=kind == "per_element").energies
    got = {z: float(model.atomref[z]) for z in want}
    assert got == pytest.approx(want, rel=1e-12)
    distinct = len({round(v, 9) for v in got.values()})
    assert (distinct == 1) == (kind == "per_atom") and len(got) > 1
    assert np.isfinite(list(got.values())).all()
