"""Cell-list neighbour lists against ASE's reference implementation."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from ase.build import bulk, molecule
from ase.neighborlist import neighbor_list as ase_neighbor_list

from convergent.models.atoms import (
    NeighborOverflowError,
    all_pairs,
    neighbor_list,
    vesin_available,
)

BACKENDS = ["torch", pytest.param("vesin", marks=pytest.mark.skipif(
    not vesin_available(), reason="vesin not installed (the 'vesin' extra)"))]


def _pairs_ours(atoms, cutoff, **kw):
    per = bool(atoms.pbc.any())
    nl = neighbor_list(
        torch.tensor(atoms.positions),
        cutoff,
        cell=torch.tensor(atoms.cell.array) if per else None,
        pbc=torch.tensor(atoms.pbc) if per else None,
        **kw,
    )
    return nl, set(zip(nl.edge_index[0].tolist(), nl.edge_index[1].tolist(),
                       map(tuple, nl.cell_shifts.tolist()), strict=True))


def _pairs_ase(atoms, cutoff):
    i, j, s = ase_neighbor_list("ijS", atoms, cutoff)
    return set(zip(i.tolist(), j.tolist(), map(tuple, s.tolist()), strict=True))


def _cases():
    benz = molecule("C6H6")
    cu = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((3, 3, 3))
    cu.rattle(0.2, seed=1)
    cu.positions += 5.0  # atoms outside the cell must be wrapped
    prim = bulk("Cu", "fcc", a=3.6)  # triclinic cell much smaller than the cutoff
    prim.rattle(0.1, seed=2)
    slab = bulk("Si", "diamond", a=5.43).repeat((2, 1, 1))
    slab.pbc = [True, False, True]  # mixed periodicity
    slab.rattle(0.05, seed=3)
    return [(benz, 3.0), (cu, 4.0), (prim, 6.0), (slab, 4.0)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(4))
def test_matches_ase_including_periodic_images(case, backend):
    atoms, cutoff = _cases()[case]
    nl, ours = _pairs_ours(atoms, cutoff, backend=backend)
    ref = _pairs_ase(atoms, cutoff)
    assert ours == ref
    # Distances and shift vectors agree with the positions.
    i, j = nl.edge_index
    pos = torch.tensor(atoms.positions)
    d = (pos[j] - pos[i] + nl.shifts).norm(dim=1)
    assert torch.allclose(d, nl.distances, atol=1e-9)
    assert float(d.max()) < cutoff


def test_batches_never_connect_molecules():
    a, b = molecule("H2O"), molecule("CH4")
    b.positions += 0.3  # overlapping in space, different molecules
    pos = torch.tensor(np.concatenate([a.positions, b.positions]))
    batch = torch.tensor([0] * len(a) + [1] * len(b))
    nl = neighbor_list(pos, 5.0, batch=batch)
    i, j = nl.edge_index
    assert nl.num_edges == len(a) * (len(a) - 1) + len(b) * (len(b) - 1)
    assert bool((batch[i] == batch[j]).all())


def test_cap_raises_by_default_and_never_truncates_silently(caplog):
    atoms = molecule("C6H6")
    pos = torch.tensor(atoms.positions)
    full = neighbor_list(pos, 5.0)
    assert full.max_count == 11
    with pytest.raises(NeighborOverflowError, match="max_neighbors=4"):
        neighbor_list(pos, 5.0, max_neighbors=4)
    with caplog.at_level(logging.WARNING):
        capped = neighbor_list(pos, 5.0, max_neighbors=4, overflow="drop")
    assert capped.n_dropped == full.num_edges - 4 * len(atoms)
    assert "dropped" in caplog.text
    assert int(torch.bincount(capped.edge_index[0]).max()) == 4
    # The kept neighbours are the nearest ones.
    for c in range(len(atoms)):
        kept = capped.distances[capped.edge_index[0] == c].max()
        allc = torch.sort(full.distances[full.edge_index[0] == c]).values
        assert float(kept) == pytest.approx(float(allc[3]))


def test_large_box_matches_ase_and_chunking():
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((5, 5, 5))  # 500 atoms
    atoms.rattle(0.1, seed=4)
    _, ours = _pairs_ours(atoms, 3.0, chunk_size=97)
    assert ours == _pairs_ase(atoms, 3.0)


def test_all_pairs_minimum_image():
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((3, 3, 3))
    pos = torch.tensor(atoms.positions)
    ei, sh = all_pairs(pos, torch.zeros(len(atoms), dtype=torch.int64), 1,
                       torch.tensor(atoms.cell.array), torch.tensor(atoms.pbc))
    assert ei.shape[1] == len(atoms) * (len(atoms) - 1)
    d = (pos[ei[1]] - pos[ei[0]] + sh).norm(dim=1)
    assert float(d.min()) == pytest.approx(3.6 / 2**0.5, rel=1e-6)
    assert float(d.max()) <= 0.5 * 3 * 3.6 * 3**0.5 + 1e-6


def test_small_molecule_path_equals_cell_list_path():
    from convergent.models.atoms import _small_molecule_pairs

    cluster = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((4, 4, 4))  # 256 atoms, non-periodic
    cluster.pbc = False
    cluster.rattle(0.1, seed=5)
    pos = torch.tensor(cluster.positions)
    batch = torch.zeros(len(cluster), dtype=torch.int64)
    nl = neighbor_list(pos, 4.0, batch=batch)  # sum n^2 > 32 N: cell-list path
    src, dst, _ = _small_molecule_pairs(pos, batch, torch.bincount(batch), 4.0)
    assert set(zip(src.tolist(), dst.tolist(), strict=True)) == set(
        zip(nl.edge_index[0].tolist(), nl.edge_index[1].tolist(), strict=True))
    assert _pairs_ours(cluster, 4.0)[1] == _pairs_ase(cluster, 4.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_of_periodic_cells_uses_each_molecules_cell(backend):
    """Two crystals with different cells in one batch: pairs as ASE, shifts from the right cell."""
    cases = _cases()
    (cu, _), (prim, _) = cases[1], cases[2]
    cutoff = 4.0
    pos = torch.tensor(np.concatenate([cu.positions, prim.positions]))
    batch = torch.tensor([0] * len(cu) + [1] * len(prim))
    cell = torch.tensor(np.stack([cu.cell.array, prim.cell.array]))
    nl = neighbor_list(pos, cutoff, batch=batch, cell=cell, pbc=torch.ones(2, 3, dtype=torch.bool),
                       backend=backend)
    i, j = nl.edge_index
    d = (pos[j] - pos[i] + nl.shifts).norm(dim=1)
    assert torch.allclose(d, nl.distances, atol=1e-9)
    assert bool((nl.shifts[(nl.cell_shifts == 0).all(1)] == 0).all())
    for b, (atoms, off) in enumerate([(cu, 0), (prim, len(cu))]):
        m = batch[i] == b
        ours = set(zip((i[m] - off).tolist(), (j[m] - off).tolist(),
                       map(tuple, nl.cell_shifts[m].tolist()), strict=True))
        assert ours == _pairs_ase(atoms, cutoff)


def _edges(nl):
    return sorted(zip(nl.edge_index[0].tolist(), nl.edge_index[1].tolist(),
                      map(tuple, nl.cell_shifts.tolist()), nl.distances.tolist(), strict=True))


@pytest.mark.skipif(not vesin_available(), reason="vesin not installed (the 'vesin' extra)")
@pytest.mark.parametrize("seed", range(6))
def test_vesin_and_torch_give_the_same_pairs_on_random_periodic_cells(seed):
    """Random triclinic cells (some smaller than the cutoff, some with mixed periodicity),
    atoms outside their cell, batched with interleaved molecule indices: the same
    (centre, neighbour, lattice shift) edges and distances from both backends."""
    rng = np.random.default_rng(seed)
    pos, batch, cells, pbcs = [], [], [], []
    n_mol = 3
    for b in range(n_mol):
        cell = np.diag(rng.uniform(2.5, 9.0, 3)) + rng.uniform(-1.0, 1.0, (3, 3)) * (1 - np.eye(3))
        n = int(rng.integers(1, 40))
        frac = rng.uniform(-0.5, 1.5, (n, 3))  # also outside the cell
        pos.append(frac @ cell)
        batch += [b] * n
        cells.append(cell)
        pbcs.append(rng.random(3) < 0.8)
    pos_t = torch.tensor(np.concatenate(pos))
    perm = torch.from_numpy(rng.permutation(len(batch)))  # molecules not contiguous
    pos_t, batch_t = pos_t[perm], torch.tensor(batch)[perm]
    kw = dict(batch=batch_t, n_molecules=n_mol, cell=torch.tensor(np.stack(cells)),
              pbc=torch.tensor(np.stack(pbcs)))
    cutoff = float(rng.uniform(2.0, 5.0))
    ours = neighbor_list(pos_t, cutoff, backend="torch", **kw)
    theirs = neighbor_list(pos_t, cutoff, backend="vesin", **kw)
    a, b = _edges(ours), _edges(theirs)
    assert [e[:3] for e in a] == [e[:3] for e in b] and len(a) > 0
    assert np.allclose([e[3] for e in a], [e[3] for e in b], atol=1e-9)
    assert theirs.max_count == ours.max_count
    # the Cartesian shifts come from each molecule's own cell
    i, j = theirs.edge_index
    d = (pos_t[j] - pos_t[i] + theirs.shifts).norm(dim=1)
    assert torch.allclose(d, theirs.distances, atol=1e-9)
    # with a neighbour cap both keep the nearest ones
    cap = max(1, ours.max_count // 2)
    kept_t = neighbor_list(pos_t, cutoff, backend="torch", max_neighbors=cap, overflow="drop", **kw)
    kept_v = neighbor_list(pos_t, cutoff, backend="vesin", max_neighbors=cap, overflow="drop", **kw)
    assert kept_t.n_dropped == kept_v.n_dropped > 0
    assert np.allclose(sorted(kept_t.distances.tolist()), sorted(kept_v.distances.tolist()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_surface_slab_with_vacuum_matches_ase(backend):
    """A slab periodic in x and y with its atoms 6 Å and more up the non-periodic z axis:
    every atom has its in-plane images (the torch cell list once gave atoms outside the
    first Å along a non-periodic direction none)."""
    from ase.build import fcc111

    slab = fcc111("Cu", size=(2, 2, 3), vacuum=6.0)
    slab.pbc = [True, True, False]
    slab.rattle(0.05, seed=4)
    assert _pairs_ours(slab, 3.0, backend=backend)[1] == _pairs_ase(slab, 3.0)
