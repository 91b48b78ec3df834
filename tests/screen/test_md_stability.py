"""Issue 37, finding 1: molecules collapsed in MD with the surrogate (no short range).

On the demo's model (commit 6e9b568, trained on σ = 0.05 Å rattles only) Langevin MD at
300 K fused two H atoms of one heavy atom in 4/4 seeds of H2O, and closing ethane's H-C-H
angle *lowered* the energy (-0.89 eV at H-H 0.8 Å, xTB +4.3 eV). Here a surrogate is
trained the way the pipeline trains one — a real GFN2-xTB campaign (tblite, Dask) of G2
molecules with the default sampler, then energy + force fitting — and must keep those
molecules bonded over 0.5 ps in 4/4 seeds and rise along the H-H scan as xTB does.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

torch = pytest.importorskip("torch")

MOLECULES = ("H2O", "NH3", "CH4", "C2H6", "CH3OH")


def _fit(records: list[dict], steps: int = 1500, seed: int = 0, force_weight: float = 1.0,
         hidden: int = 48, layers: int = 2):
    from convergent.models.batching import collate_records
    from convergent.models.config import ModelConfig
    from convergent.models.losses import energy_force_loss
    from convergent.models.molecular import build_model, energy_and_forces, fit_reference_energies

    torch.manual_seed(seed)
    cfg = ModelConfig(hidden=hidden, layers=layers)  # the defaults otherwise: the ZBL prior on
    model = build_model(cfg)
    model.set_reference(fit_reference_energies(records))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=1e-4)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        batch = collate_records([records[i] for i in rng.choice(len(records), 32, replace=False)])
        e, f = energy_and_forces(model, batch, training=True)
        loss, _ = energy_force_loss(e, f, batch, force_weight=force_weight)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return model.eval(), cfg


@pytest.fixture(scope="module")
def surrogate(tmp_path_factory):
    """A surrogate trained on a real xTB campaign of small G2 molecules (default sampler)."""
    from convergent.cluster.config import ClusterConfig
    from convergent.cluster.pool import dask_client
    from convergent.data.reader import open_dataset
    from convergent.models.io import save_model
    from convergent.sim.campaign import run_campaign
    from convergent.sim.config import SimulateConfig

    root = tmp_path_factory.mktemp("md")
    sim = SimulateConfig(source="g2", max_atoms=8, frames=600, chunk_size=50)
    with dask_client(ClusterConfig(n_workers=2)) as client:
        run_campaign(sim, ClusterConfig(), root / "labels", progress=False, client=client)
    ds = open_dataset(root / "labels")
    records = list(ds)
    ds.close()
    model, cfg = _fit(records)
    return save_model(model, cfg, root / "model"), records


def test_the_campaign_reaches_the_short_range(surrogate):
    _, records = surrogate
    kinds = [r["meta"].get("distort") for r in records]
    assert 0.1 < sum(k is not None for k in kinds) / len(records) < 0.3
    assert {"compress", "angle", "bond"} <= set(kinds)
    hh = [np.linalg.norm(r["positions"][i] - r["positions"][j])
          for r in records for i, j in _hh_pairs(r["numbers"])]
    assert min(hh) < 1.1  # Å: H-H pairs well inside their equilibrium ~1.5-1.8 Å
    # and between molecules: dimers, some with a partner of another kind, from close
    # contact to where they hardly interact, labelled by xTB like every other frame
    dimers = [r for r in records if r["meta"].get("dimer")]
    assert 0.03 < len(dimers) / len(records) < 0.2
    contact = np.array([r["meta"]["dimer"]["contact"] for r in dimers])
    assert contact.min() < 2.0 and contact.max() > 3.5
    assert any(r["meta"]["dimer"]["partner"] != r["molecule_id"] for r in dimers)
    assert all(np.isfinite(r["energy"]) and len(r["forces"]) == len(r["numbers"]) for r in dimers)


def _hh_pairs(z):
    h = np.flatnonzero(np.asarray(z) == 1)
    return [(a, b) for k, a in enumerate(h) for b in h[k + 1:]]


def test_molecules_stay_bonded_over_half_a_picosecond_at_300k(surrogate):
    from convergent.screen.mdcheck import md_check

    model_dir, _ = surrogate
    res = md_check(model_dir, MOLECULES, seeds=4, temperature_K=300.0, time_fs=500.0)
    assert len(res.runs) == 4 * len(MOLECULES)
    assert res.stable == len(res.runs), res.line()


def _ethane_scan(targets):
    """Ethane with one H-C-H angle closed until the two H are ``target`` Å apart (the C-H
    length kept): the issue's scan."""
    from ase.build import molecule

    base = molecule("C2H6")
    z = base.numbers
    c = 0
    hs = [i for i in range(len(z)) if z[i] == 1 and np.linalg.norm(base.positions[i] - base.positions[c]) < 1.3]
    j, k = hs[0], hs[1]
    out = []
    for t in targets:
        a = base.copy()
        p = a.positions
        u, w = p[j] - p[c], p[k] - p[c]
        lw = np.linalg.norm(w)
        best = None
        for s in np.linspace(0, 1, 2001):
            v = (1 - s) * w / lw + s * u / np.linalg.norm(u)
            q = p[c] + lw * v / np.linalg.norm(v)
            if best is None or abs(np.linalg.norm(q - p[j]) - t) < abs(np.linalg.norm(best - p[j]) - t):
                best = q
        p[k] = best
        a.positions = p
        out.append(a)
    return base, out


def test_closing_an_hch_angle_raises_the_energy_as_xtb_does(surrogate):
    from convergent.models.calculator import SurrogateCalculator
    from convergent.sim.calculators import CalcSpec, make_calculator

    model_dir, _ = surrogate
    targets = [1.4, 1.2, 1.0, 0.8]
    base, scan = _ethane_scan(targets)
    rise = {}
    for name, make in (("model", lambda: SurrogateCalculator(model_dir)),
                       ("xtb", lambda: make_calculator(CalcSpec(kind="xtb")))):
        energies = []
        for a in [base, *scan]:
            a = a.copy()
            a.calc = make()
            energies.append(a.get_potential_energy())
        rise[name] = np.array(energies[1:]) - energies[0]
    m, x = rise["model"], rise["xtb"]
    assert (np.diff(x) > 0).all() and x[-1] > 3.0  # xTB: +4.3 eV at 0.8 Å
    assert (np.diff(m) > 0).all(), (m, x)  # rises monotonically as H-H shrinks
    # as xTB's does: within a factor of two where xTB has risen by more than 1 eV
    big = x > 1.0
    assert (m[big] > 0.5 * x[big]).all() and (m[big] < 2.0 * x[big]).all(), (m, x)


def _pairs(separation: float, n: int = 4, seed: int = 0):
    """Water and methane, each rotated at random, their O and C ``separation`` Å apart."""
    from ase.build import molecule

    rng = np.random.default_rng(seed)
    w, m = molecule("H2O"), molecule("CH4")
    out = []
    for _ in range(n):
        a, b = w.copy(), m.copy()
        for x in (a, b):
            x.rotate(rng.uniform(0, 360), rng.normal(size=3))
        a.translate(-a.positions[0])
        b.translate(-b.positions[0])
        u = rng.normal(size=3)
        b.translate(separation * u / np.linalg.norm(u))
        out.append(a + b)
    return w, m, out


@pytest.mark.slow
def test_a_water_methane_pair_does_not_bind_where_xtb_does_not(tmp_path):
    """The issue's pair: the demo's model bound water to methane by -0.98 eV at 3.5 Å (xTB
    -0.011). A surrogate trained on a campaign with dimers (partners of other kinds among
    them) follows xTB's interaction energy E(pair) - E(water) - E(methane) over 2.5-5 Å
    to within the model's precision — about 0.01 eV/atom on ~10-atom structures here, so
    0.75 eV at most — repels at contact and never binds by more than 0.25 eV (xTB: by 0.03
    eV at most); trained on the same campaign without dimers it gave -1.3 to +2.5 eV over
    the same range."""
    from convergent.cluster.config import ClusterConfig
    from convergent.cluster.pool import dask_client
    from convergent.data.reader import open_dataset
    from convergent.models.calculator import SurrogateCalculator
    from convergent.models.io import save_model
    from convergent.sim.calculators import CalcSpec, make_calculator
    from convergent.sim.campaign import run_campaign
    from convergent.sim.config import SimulateConfig

    sim = SimulateConfig(source="g2", max_atoms=5, frames=600, chunk_size=50, dimer_fraction=0.5)
    with dask_client(ClusterConfig(n_workers=2)) as client:
        run_campaign(sim, ClusterConfig(), tmp_path / "labels", progress=False, client=client)
    ds = open_dataset(tmp_path / "labels")
    records = list(ds)
    ds.close()
    # energies weighed up against forces: the interaction is a small difference of totals
    model, cfg = _fit(records, steps=4000, force_weight=0.05, hidden=64, layers=3)
    model_dir = save_model(model, cfg, tmp_path / "model")
    calcs = {"model": SurrogateCalculator(model_dir), "xtb": make_calculator(CalcSpec(kind="xtb"))}

    def energy(atoms, name):  # noqa: ANN001
        atoms = atoms.copy()
        atoms.calc = calcs[name]
        return atoms.get_potential_energy()

    for sep in (2.5, 3.0, 3.5, 4.0, 5.0):
        w, m, pairs = _pairs(sep)
        inter = {name: np.array([energy(p, name) - energy(w, name) - energy(m, name) for p in pairs])
                 for name in calcs}
        assert inter["xtb"].min() > -0.05  # xTB: at most a weak attraction on this range
        assert inter["model"].min() > -0.25, (sep, inter)  # no spurious binding
        assert np.abs(inter["model"] - inter["xtb"]).max() < 0.75, (sep, inter)
        if sep == 2.5:  # at contact the pair repels, as xTB's (+0.4 to +0.8 eV)
            assert inter["model"].mean() > 0.1, inter
