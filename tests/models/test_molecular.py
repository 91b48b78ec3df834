"""The molecular Transformer: invariances, forces, batching, precision, references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase.build import bulk, molecule
from scipy.spatial.transform import Rotation

from convergent.models.batching import atoms_to_record, batches_by_atom_budget, collate_records
from convergent.models.config import ModelConfig
from convergent.models.losses import energy_force_loss
from convergent.models.molecular import (
    build_model,
    energy_and_forces,
    fit_reference_energies,
)

VARIANTS = pytest.mark.parametrize(
    "kw",
    [{"attention_weights": "softmax"}, {"attention_weights": "silu"},
     {"attention_weights": "softmax", "vectors": True}, {"attention_weights": "silu", "vectors": True}],
    ids=["softmax", "silu", "softmax-vectors", "silu-vectors"],
)


def _model(**kw):
    torch.manual_seed(0)
    m = build_model(ModelConfig(hidden=32, layers=2, heads=4, **kw))
    # Non-trivial reference / scale so they are exercised.
    m.atomref[1], m.atomref[6], m.atomref[8] = -13.0, -1000.0, -2000.0
    m.scale.fill_(2.0)
    return m.double()


def _rec(atoms, key="a"):
    return atoms_to_record(atoms, key)


def _energy(m, recs):
    b = collate_records(recs, dtype=torch.float64)
    return energy_and_forces(m, b, training=False)


@VARIANTS
def test_rotation_translation_permutation_invariance(kw):
    m = _model(**kw)
    a = molecule("CH3CH2OH")
    e0, f0 = _energy(m, [_rec(a)])
    rot = Rotation.from_euler("xyz", [0.3, 1.1, -0.7]).as_matrix()
    b = a.copy()
    b.positions = a.positions @ rot.T + np.array([3.0, -2.0, 7.5])
    e1, f1 = _energy(m, [_rec(b)])
    assert float(e1) == pytest.approx(float(e0), abs=1e-9)
    assert torch.allclose(f1, f0 @ torch.tensor(rot.T), atol=1e-9)  # forces rotate with atoms
    perm = np.random.default_rng(0).permutation(len(a))
    c = a[perm]
    e2, f2 = _energy(m, [_rec(c)])
    assert float(e2) == pytest.approx(float(e0), abs=1e-9)
    assert torch.allclose(f2, f0[perm], atol=1e-9)
    # and the energy is not trivially constant
    d = a.copy()
    d.positions[0] += 0.2
    assert abs(float(_energy(m, [_rec(d)])[0]) - float(e0)) > 1e-6


@VARIANTS
def test_forces_are_minus_gradient_finite_difference(kw):
    m = _model(**kw)
    a = molecule("H2O")
    a.rattle(0.05, seed=1)
    _, f = _energy(m, [_rec(a)])
    h = 1e-5
    for atom, axis in [(0, 0), (1, 2), (2, 1)]:
        p, q = a.copy(), a.copy()
        p.positions[atom, axis] += h
        q.positions[atom, axis] -= h
        fd = -(float(_energy(m, [_rec(p)])[0]) - float(_energy(m, [_rec(q)])[0])) / (2 * h)
        assert float(f[atom, axis]) == pytest.approx(fd, rel=1e-5, abs=1e-7)


@VARIANTS
def test_energy_smooth_when_atom_crosses_cutoff(kw):
    m = _model(cutoff=3.0, **kw)
    a = molecule("H2")

    def e_at(r):
        a.positions[0] = [0, 0, 0]
        a.positions[1] = [0, 0, r]
        return float(_energy(m, [_rec(a)])[0])

    outside = e_at(3.05)
    assert e_at(3.0001) == outside  # no interaction beyond the cutoff
    near, far = abs(e_at(2.9999) - outside), abs(e_at(2.99) - outside)
    assert near < 1e-7 and far > 100 * near  # continuous, vanishing like (rc - r)^2


@pytest.mark.parametrize("vectors", [False, True])
def test_batch_equals_single_molecules_and_periodic_image_invariance(vectors):
    m = _model(vectors=vectors)
    mols = [molecule("H2O"), molecule("C6H6"), molecule("CH4")]
    e_batch, f_batch = _energy(m, [_rec(x, str(i)) for i, x in enumerate(mols)])
    singles = [_energy(m, [_rec(x)]) for x in mols]
    assert torch.allclose(e_batch, torch.cat([s[0] for s in singles]), atol=1e-9)
    assert torch.allclose(f_batch, torch.cat([s[1] for s in singles]), atol=1e-9)
    # Periodic: moving an atom by a lattice vector changes nothing.
    cu = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 2, 2))
    cu.rattle(0.1, seed=0)
    e0, f0 = _energy(m, [_rec(cu)])
    cu2 = cu.copy()
    cu2.positions[3] += cu.cell[0] - 2 * cu.cell[2]
    e1, f1 = _energy(m, [_rec(cu2)])
    assert float(e1) == pytest.approx(float(e0), abs=1e-8)
    assert torch.allclose(f0, f1, atol=1e-8)
    assert float(f0.sum(0).abs().max()) < 1e-8  # momentum conservation


def test_edge_chunking_gives_same_energy_forces_and_gradients():
    cu = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 2, 2))
    cu.rattle(0.1, seed=1)
    recs = [_rec(cu, "cu"), _rec(molecule("C6H6"), "b")]
    out = []
    for chunk in (0, 37):  # 37 edges: many chunks of uneven size
        m = _model(edge_chunk=chunk)
        b = collate_records(recs, dtype=torch.float64)
        e, f = energy_and_forces(m, b, training=True)
        (e.sum() + (f * f).sum()).backward()
        grads = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
        out.append((e.detach(), f.detach(), grads))
    assert m.last_neighbors.num_edges > 10 * 37
    for a, b in zip(out[0], out[1], strict=True):
        assert torch.allclose(a, b, atol=1e-9, rtol=1e-9)
    assert float(out[0][2].abs().sum()) > 0


def test_topk_with_all_neighbours_equals_dense_and_modes_run():
    base = _model()
    recs = [_rec(molecule("H2O"), "w"), _rec(molecule("C6H6"), "b")]
    out = {}
    for att, k in [("dense", 0), ("topk", 100), ("topk", 3)]:
        m = _model(attention=att, topk=max(k, 1))
        m.load_state_dict(base.state_dict())
        out[(att, k)] = _energy(m, recs)
    assert torch.allclose(out[("dense", 0)][0], out[("topk", 100)][0], atol=1e-9)
    assert not torch.allclose(out[("dense", 0)][0], out[("topk", 3)][0], atol=1e-6)
    # neighbour mode with a cutoff beyond the molecule differs from dense only by the
    # envelope; both are finite
    assert torch.isfinite(out[("topk", 3)][1]).all()


@pytest.mark.numerics
def test_bf16_autocast_keeps_energy_head_fp32():
    m = _model().float()
    seen = {}
    m.energy_head[1].register_forward_hook(lambda mod, i, o: seen.__setitem__("head", o.dtype))
    m.layers[0].qkv.register_forward_hook(lambda mod, i, o: seen.__setitem__("qkv", o.dtype))
    b = collate_records([_rec(molecule("C6H6"))])
    e32, f32 = energy_and_forces(m, b, training=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        e16, f16 = energy_and_forces(m, b, training=True)
    assert seen == {"head": torch.float32, "qkv": torch.bfloat16}
    assert e16.dtype == torch.float64 and f16.dtype == torch.float32
    # Tolerance from bf16's eps, at the size of what bf16 computes: the per-element
    # references (fp64, ~6078 eV here) are exact, so the error scales with the network's
    # own per-atom contributions (sum of |E_atom - atomref|, ~1 eV), not with the total
    # energy (the old rtol=1e-3 on ~6079 eV allowed 6 eV, more than the network's part).
    # bf16 rounds every layer's activations (<= eps/2 each); 4 eps covers that with room
    # (measured ~0.05 eps for energies, ~0.5 eps of max |F| for forces, on ATen's default,
    # AVX2 and AVX-512 kernels alike).
    eps = torch.finfo(torch.bfloat16).eps
    with torch.no_grad():
        _, atom_e = m(b, per_atom=True)
    net = float((atom_e - m.atomref[b.numbers].to(atom_e.dtype)).abs().sum())
    assert 0.1 < net < 100  # the network's part is neither negligible nor dominant
    assert float((e16 - e32).detach().abs().max()) <= 4 * eps * net
    assert float((f16 - f32).detach().abs().max()) <= 4 * eps * float(f32.detach().abs().max())
    m.set_keep_fp32([])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        energy_and_forces(m, b, training=False)
    assert seen["head"] == torch.bfloat16


def test_fit_reference_energies_recovers_linear_model():
    rng = np.random.default_rng(0)
    true = {1: -13.6, 6: -1029.0, 8: -2041.0}
    recs = []
    for _ in range(40):
        z = rng.choice([1, 6, 8], size=rng.integers(3, 12))
        recs.append({"numbers": z, "positions": np.zeros((len(z), 3)),
                     "energy": sum(true[int(x)] for x in z) + rng.normal(0, 0.01),
                     "forces": np.full((len(z), 3), 0.5)})
    ref = fit_reference_energies(recs)
    for z, e in true.items():
        assert ref.energies[z] == pytest.approx(e, abs=0.05)
    assert ref.scale == pytest.approx(0.5)
    m = build_model(ModelConfig(hidden=16, layers=1))
    m.set_reference(ref)
    assert float(m.atomref[8]) == pytest.approx(true[8], abs=0.05)
    # the ablation: one energy per atom for every element, the least-squares mean
    shared = fit_reference_energies(recs, ridge=0, per_element=False)
    n = np.array([len(r["numbers"]) for r in recs], dtype=float)
    mu = float(n @ np.array([r["energy"] for r in recs]) / (n @ n))
    assert set(shared.energies) == set(true)
    assert all(e == pytest.approx(mu, rel=1e-9) for e in shared.energies.values())


def test_loss_and_training_step_reduce_error():
    torch.manual_seed(0)
    m = build_model(ModelConfig(hidden=32, layers=2))
    mols = []
    for i, name in enumerate(["H2O", "NH3", "CH4"] * 3):
        a = molecule(name)
        a.rattle(0.05, seed=i)
        r = _rec(a, f"k{i}")
        # synthetic harmonic labels: E = sum |x|^2, F = -2x
        x = r["positions"] - r["positions"].mean(0)
        r["energy"] = float((x ** 2).sum())
        r["forces"] = -2 * x
        mols.append(r)
    m.set_reference(fit_reference_energies(mols))
    b = collate_records(mols)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        e, f = energy_and_forces(m, b, training=True)
        loss, met = energy_force_loss(e, f, b, force_weight=1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert set(met) >= {"energy_mae", "force_mae"}
    assert losses[-1] < 0.5 * losses[0]


def test_atom_budget_batching():
    counts = [5, 30, 7, 7, 100, 3, 12]
    batches = batches_by_atom_budget(counts, 40)
    assert sorted(i for b in batches for i in b) == list(range(len(counts)))
    for b in batches:
        assert sum(counts[i] for i in b) <= 40 or len(b) == 1
    assert [4] in batches  # oversized molecule alone, not dropped
    s1 = batches_by_atom_budget(counts, 40, shuffle_seed=1)
    assert s1 == batches_by_atom_budget(counts, 40, shuffle_seed=1)
    assert sorted(i for b in s1 for i in b) == list(range(len(counts)))


def test_collate_treats_nan_labels_as_missing():
    a = _rec(molecule("H2O"), "x")
    a["energy"] = float("nan")
    a["forces"] = np.full((3, 3), np.nan)
    b = collate_records([a, _rec(molecule("CH4"), "y")])
    assert b.energy is None and b.forces is None
    assert b.batch.tolist() == [0] * 3 + [1] * 5 and b.n_atoms.tolist() == [3, 5]


def test_silu_weights_sum_over_neighbours_softmax_averages():
    """softmax weights of a centre sum to < 1 (weighted mean plus the sink slot); silu
    weights are the unnormalised gate silu(score) · envelope."""
    from convergent.models.edge_attention import EdgeAttentionBlock

    torch.manual_seed(0)
    score = torch.randn(4, 2)
    src = torch.tensor([0, 0, 0, 1])
    env = torch.tensor([1.0, 0.5, 0.2, 1.0])
    soft = EdgeAttentionBlock(8, 2, 4, 2, "softmax")._weights(score, src, env, 2)
    per_centre = torch.zeros(2, 2).index_add(0, src, soft)
    assert (soft > 0).all() and (per_centre < 1).all() and (per_centre > 0.3).all()
    silu = EdgeAttentionBlock(8, 2, 4, 2, "silu")._weights(score, src, env, 2)
    assert torch.allclose(silu, torch.nn.functional.silu(score) * env.unsqueeze(1))
    with pytest.raises(ValueError):
        EdgeAttentionBlock(8, 2, 4, 2, "relu")


@pytest.mark.parametrize("vectors", [False, True])
def test_vector_channel_sees_bond_angles_beyond_the_cutoff_pairs(vectors):
    """H-O-H with both O-H = 1 Å inside a 1.5 Å cutoff and H...H outside it (angle >= 100°):
    a distance-only model cannot tell the angles apart; the vector channel can."""
    from ase import Atoms

    m = _model(cutoff=1.5, vectors=vectors)

    def e_at(angle_deg):
        t = np.radians(angle_deg)
        a = Atoms("HOH", positions=[[1.0, 0, 0], [0, 0, 0], [np.cos(t), np.sin(t), 0]])
        return float(_energy(m, [_rec(a)])[0])

    spread = abs(e_at(110.0) - e_at(170.0))
    if vectors:
        assert spread > 1e-6  # small at initialisation, but far above round-off
    else:
        assert spread < 1e-12


def test_vectors_refuse_edge_chunking():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="edge_chunk"):
        ModelConfig(vectors=True, edge_chunk=64)
    assert ModelConfig(vectors=False, edge_chunk=64).edge_chunk == 64
