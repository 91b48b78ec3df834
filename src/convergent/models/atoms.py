"""Neighbour lists in pure torch: cell lists (O(N)), cutoff, optional cap, periodic cells.

Convention: an edge ``(i, j)`` with ``edge_index[0] = i`` (the centre, the atom that
attends) and ``edge_index[1] = j`` (its neighbour). The vector from ``i`` to the image of
``j`` is ``positions[j] - positions[i] + shifts[e]`` with ``shifts = cell_shifts @ cell``
(Cartesian, Å). Edges never connect two molecules of a batch. Both directions of a pair
are listed (``(i, j)`` and ``(j, i)``) unless ``max_neighbors`` dropped one of them.

Algorithm: periodic structures are wrapped into their cell and surrounded by "ghost"
images of the atoms within ``cutoff`` of a face (any cell shape, any cell size: small
cells get several image layers). Centres and candidates (atoms + ghosts) are binned into
cubic cells of side ``cutoff`` keyed by (molecule, cell); each centre is compared with the
candidates of the 27 surrounding cells only. Work and memory are O(N) for a fixed
density; centres are processed in chunks to bound the temporary pair buffers.

Periodic structures on the CPU go to `vesin <https://github.com/Luthaf/vesin>`_ when it is
installed (the ``vesin`` extra; ``backend="auto"``): the same pairs and shifts (in
another order), faster in ``bench/models/neighbors.py``. The torch cell list above is the
fallback and the path for GPU tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from convergent.core.errors import ConvergentError

log = logging.getLogger(__name__)


class NeighborOverflowError(ConvergentError):
    """An atom has more neighbours within the cutoff than ``max_neighbors`` allows."""


@dataclass
class NeighborList:
    """Edges of the cutoff graph.

    ``edge_index`` int64[2, E] (centre, neighbour); ``shifts`` float[E, 3] Cartesian image
    shift in Å; ``cell_shifts`` int64[E, 3] in lattice vectors; ``distances`` float[E] Å
    (computed without gradient); ``n_dropped`` pairs removed by ``max_neighbors`` with
    ``overflow="drop"``; ``max_count`` the largest neighbour count seen before any cap.
    Edges are sorted by centre (CSR): centre ``i``'s edges are ``row_ptr[i]:row_ptr[i+1]``
    of ``row_ptr`` int64[N+1], so per-centre reductions are segment sums over contiguous
    ranges (:mod:`convergent.models.segments`).
    """

    edge_index: torch.Tensor
    shifts: torch.Tensor
    cell_shifts: torch.Tensor
    distances: torch.Tensor
    n_dropped: int = 0
    max_count: int = 0
    row_ptr: torch.Tensor | None = None

    @property
    def num_edges(self) -> int:
        return int(self.edge_index.shape[1])


_OFFSETS_27 = torch.tensor(
    [[a, b, c] for a in (-1, 0, 1) for b in (-1, 0, 1) for c in (-1, 0, 1)], dtype=torch.int64
)


def _as_batch_cells(
    n_molecules: int,
    cell: torch.Tensor | None,
    pbc: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise ``cell`` to [B,3,3] and ``pbc`` to bool[B,3] (zeros / False if absent)."""
    if cell is None:
        cells = torch.zeros(n_molecules, 3, 3, dtype=dtype, device=device)
    else:
        cells = cell.to(device=device, dtype=dtype)
        if cells.dim() == 2:
            cells = cells.unsqueeze(0).expand(n_molecules, 3, 3)
    if pbc is None:
        pbcs = torch.zeros(n_molecules, 3, dtype=torch.bool, device=device)
    else:
        pbcs = pbc.to(device=device, dtype=torch.bool)
        if pbcs.dim() == 1:
            pbcs = pbcs.unsqueeze(0).expand(n_molecules, 3)
    if cells.shape != (n_molecules, 3, 3) or pbcs.shape != (n_molecules, 3):
        raise ValueError(f"cell/pbc shapes {tuple(cells.shape)}/{tuple(pbcs.shape)} "
                         f"do not match {n_molecules} molecules")
    return cells, pbcs


def _wrap_and_ghosts(
    pos: torch.Tensor,
    batch: torch.Tensor,
    cells: torch.Tensor,
    pbcs: torch.Tensor,
    cutoff: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Wrap periodic atoms into their cell; build ghost images near the faces.

    Returns ``(wrapped_pos, wrap_int[N,3], cand_pos[M,3], cand_atom[M], cand_shift[M,3])``
    where candidate ``m`` is atom ``cand_atom[m]`` displaced by ``cand_shift[m]`` lattice
    vectors from its wrapped position (candidates start with the N atoms themselves).
    """
    n = pos.shape[0]
    dev = pos.device
    wrap_int = torch.zeros(n, 3, dtype=torch.int64, device=dev)
    cand_pos: list[torch.Tensor] = []
    cand_atom = [torch.arange(n, device=dev)]
    cand_shift = [torch.zeros(n, 3, dtype=torch.int64, device=dev)]
    periodic_mol = pbcs.any(dim=1)
    if not bool(periodic_mol.any()):
        return pos, wrap_int, pos, cand_atom[0], cand_shift[0]

    pos = pos.clone()
    cand_pos.append(pos)  # filled in place below as molecules are wrapped
    for b in torch.nonzero(periodic_mol).flatten().tolist():
        idx = torch.nonzero(batch == b).flatten()
        if idx.numel() == 0:
            continue
        cell = cells[b].to(torch.float64)
        per = pbcs[b]
        if torch.linalg.matrix_rank(cell[per]) < int(per.sum()):
            raise ValueError(f"molecule {b}: periodic cell vectors are degenerate")
        # Non-periodic directions get a dummy orthogonal vector so frac coords exist.
        full = cell.clone()
        if not bool(per.all()):
            q, _ = torch.linalg.qr(torch.cat([cell[per].T, torch.eye(3, dtype=full.dtype, device=dev)], 1))
            k = int(per.sum())
            extra = q[:, k:3].T
            full[~per] = extra
        inv = torch.linalg.inv(full)
        p = pos[idx].to(torch.float64)
        frac = p @ inv
        wi = torch.floor(frac).to(torch.int64) * per.to(torch.int64)
        frac = frac - wi.to(frac.dtype)
        p = p - wi.to(p.dtype) @ full
        pos[idx] = p.to(pos.dtype)
        wrap_int[idx] = wi
        # Perpendicular heights of the cell -> how far (in fractions) ghosts must reach.
        vol = torch.abs(torch.det(full))
        heights = torch.stack(
            [vol / torch.linalg.norm(torch.cross(full[(k + 1) % 3], full[(k + 2) % 3], dim=0))
             for k in range(3)]
        )
        reach = (cutoff / heights) * per.to(heights.dtype)  # fraction of a cell
        nrep = torch.ceil(reach).to(torch.int64)
        ranges = [torch.arange(-int(nrep[k]), int(nrep[k]) + 1, device=dev) for k in range(3)]
        shifts = torch.cartesian_prod(*ranges).reshape(-1, 3)
        shifts = shifts[(shifts != 0).any(dim=1)]
        if shifts.numel() == 0:
            continue
        # Image fractional coords frac + s must lie within [-reach, 1 + reach).
        img = frac.unsqueeze(0) + shifts.unsqueeze(1).to(frac.dtype)  # [S, n, 3]
        # (non-periodic directions: no limit, an atom anywhere along them has images)
        ok = (((img >= -reach) & (img < 1.0 + reach)) | ~per).all(dim=2)  # [S, n]
        s_idx, a_idx = torch.nonzero(ok, as_tuple=True)
        if s_idx.numel() == 0:
            continue
        sh = shifts[s_idx]
        cand_pos.append((p[a_idx] + sh.to(p.dtype) @ full).to(pos.dtype))
        cand_atom.append(idx[a_idx])
        cand_shift.append(sh)
    return (pos, wrap_int, torch.cat(cand_pos), torch.cat(cand_atom), torch.cat(cand_shift))


def _cell_list_pairs(pos: torch.Tensor, batch: torch.Tensor, n_molecules: int, cells: torch.Tensor,
                     pbcs: torch.Tensor, cutoff: float, chunk_size: int):  # noqa: ANN202
    """(src, dst, cell shifts, distances) of every pair closer than ``cutoff`` by a cell
    list over periodic images, or None when there is none."""
    dev = pos.device
    n = pos.shape[0]
    work_dtype = torch.float64 if pos.dtype == torch.float64 else torch.float32
    posw, wrap_int, cpos, catom, cshift = _wrap_and_ghosts(
        pos.to(work_dtype), batch, cells.to(work_dtype), pbcs, float(cutoff)
    )
    cbatch = batch[catom]

    # Bin centres and candidates into cubes of side `cutoff`, origin per molecule.
    big = torch.finfo(work_dtype).max
    lo = torch.full((n_molecules, 3), big, dtype=work_dtype, device=dev)
    lo = lo.scatter_reduce(0, cbatch.unsqueeze(1).expand(-1, 3), cpos, reduce="amin")
    cc = torch.floor((cpos - lo[cbatch]) / cutoff).to(torch.int64) + 1  # >= 1
    dims = cc.max(dim=0).values + 2  # room for the -1/+1 neighbours
    nx, ny, nz = (int(d) for d in dims)

    def key(b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return ((b * nx + c[..., 0]) * ny + c[..., 1]) * nz + c[..., 2]

    ckey = key(cbatch, cc)
    order = torch.argsort(ckey)
    skey = ckey[order]
    spos = cpos[order]  # candidate positions in cell order: gathers below stay cell-local
    ukeys, counts = torch.unique_consecutive(skey, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts

    center_cc = cc[:n]  # the first N candidates are the (wrapped) atoms themselves
    offsets = _OFFSETS_27.to(dev)
    ones3 = torch.ones(3, dtype=work_dtype, device=dev)
    src_all, dst_all, sh_all, d_all = [], [], [], []
    for c0 in range(0, n, chunk_size):
        c1 = min(n, c0 + chunk_size)
        ci = torch.arange(c0, c1, device=dev)
        nb_keys = key(batch[ci].unsqueeze(1), center_cc[ci].unsqueeze(1) + offsets)  # [c,27]
        loc = torch.searchsorted(ukeys, nb_keys).clamp_max(ukeys.numel() - 1)
        found = ukeys[loc] == nb_keys
        cnt = torch.where(found, counts[loc], torch.zeros_like(loc))
        cnt_f = cnt.flatten()
        total = int(cnt_f.sum())
        if total == 0:
            continue
        # Candidate k of centre i: position st + (k - segment start) in cell order.
        rep_center = ci.repeat_interleave(cnt.sum(1))
        seg_start = torch.cumsum(cnt_f, 0) - cnt_f
        idx = torch.arange(total, device=dev) + (starts[loc].flatten() - seg_start).repeat_interleave(cnt_f)
        vec = spos[idx] - posw[rep_center]
        d2 = (vec * vec) @ ones3
        keep = d2 < cutoff * cutoff
        rep_center, d2 = rep_center[keep], d2[keep]
        cand = order[idx[keep]]
        # The centre itself is the only candidate with index == centre (ghosts are >= N).
        keep = cand != rep_center
        rep_center, cand, d2 = rep_center[keep], cand[keep], d2[keep]
        j = catom[cand]
        # Shift relative to the *unwrapped* input positions.
        sh = cshift[cand] - wrap_int[j] + wrap_int[rep_center]
        src_all.append(rep_center)
        dst_all.append(j)
        sh_all.append(sh)
        d_all.append(torch.sqrt(d2))
    if not src_all:
        return None
    return torch.cat(src_all), torch.cat(dst_all), torch.cat(sh_all), torch.cat(d_all)


@torch.no_grad()
def neighbor_list(
    positions: torch.Tensor,
    cutoff: float,
    batch: torch.Tensor | None = None,
    n_molecules: int | None = None,
    cell: torch.Tensor | None = None,
    pbc: torch.Tensor | None = None,
    max_neighbors: int | None = None,
    overflow: str = "error",
    chunk_size: int = 4096,
    backend: str = "auto",
) -> NeighborList:
    """All pairs closer than ``cutoff`` Å within each molecule (cell list, O(N)).

    ``positions`` float[N,3] Å; ``batch`` int64[N] molecule index (default all 0);
    ``cell`` [3,3] or [B,3,3] (rows are lattice vectors, Å) and ``pbc`` bool[3] or [B,3]
    for periodic structures. ``max_neighbors`` caps neighbours per centre: with
    ``overflow="error"`` an atom above the cap raises :class:`NeighborOverflowError`;
    with ``overflow="drop"`` the nearest ``max_neighbors`` are kept and the number of
    dropped pairs is logged and returned in ``n_dropped``. ``backend``: ``"torch"`` (the
    cell list here), ``"vesin"`` (CPU tensors, needs the package) or ``"auto"`` (vesin
    for periodic structures on the CPU when installed, else torch).
    """
    if cutoff <= 0:
        raise ValueError("cutoff must be positive")
    if backend not in ("auto", "torch", "vesin"):
        raise ValueError("backend must be 'auto', 'torch' or 'vesin'")
    if overflow not in ("error", "drop"):
        raise ValueError("overflow must be 'error' or 'drop'")
    pos = positions.detach()
    dev = pos.device
    n = pos.shape[0]
    if batch is None:
        batch = torch.zeros(n, dtype=torch.int64, device=dev)
    batch = batch.to(device=dev, dtype=torch.int64)
    if n_molecules is None:
        n_molecules = int(batch.max()) + 1 if n > 0 else 0
    empty = NeighborList(
        torch.zeros(2, 0, dtype=torch.int64, device=dev),
        torch.zeros(0, 3, dtype=pos.dtype, device=dev),
        torch.zeros(0, 3, dtype=torch.int64, device=dev),
        torch.zeros(0, dtype=pos.dtype, device=dev),
        row_ptr=torch.zeros(n + 1, dtype=torch.int64, device=dev),
    )
    if n == 0:
        return empty
    cells, pbcs = _as_batch_cells(n_molecules, cell, pbc, pos.dtype, dev)
    counts_mol = torch.bincount(batch, minlength=n_molecules)
    if not bool(pbcs.any()) and int((counts_mol * counts_mol).sum()) <= max(4096, 32 * n):
        # Many small molecules: all intra-molecule pairs is fewer operations than binning
        # and still O(N) for bounded molecule size (sum n_b^2 <= 32 N).
        src, dst, dist = _small_molecule_pairs(pos, batch, counts_mol, float(cutoff))
        csh = torch.zeros(src.numel(), 3, dtype=torch.int64, device=dev)
        return _finish(src, dst, csh, dist, n, batch, cells, pos.dtype, cutoff, max_neighbors, overflow)
    if _use_vesin(backend, pos, pbcs):
        src, dst, csh, dist = _vesin_pairs(pos, batch, counts_mol, cells, pbcs, float(cutoff))
        return _finish(src, dst, csh, dist, n, batch, cells, pos.dtype, cutoff, max_neighbors, overflow)
    pairs = _cell_list_pairs(pos, batch, n_molecules, cells, pbcs, float(cutoff), chunk_size)
    if pairs is None:
        return empty
    src, dst, csh, dist = pairs
    return _finish(src, dst, csh, dist, n, batch, cells, pos.dtype, cutoff, max_neighbors, overflow)


def vesin_available() -> bool:
    """Whether the ``vesin`` neighbour-list package can be imported."""
    try:
        import vesin  # noqa: F401
    except ImportError:
        return False
    return True


def _use_vesin(backend: str, pos: torch.Tensor, pbcs: torch.Tensor) -> bool:
    if backend == "torch":
        return False
    if backend == "vesin":
        if pos.device.type != "cpu" or not vesin_available():
            raise ValueError("backend='vesin' needs CPU tensors and the vesin package "
                             "(pip install 'convergent[vesin]')")
        return True
    return pos.device.type == "cpu" and bool(pbcs.any()) and vesin_available()


def _vesin_pairs(
    pos: torch.Tensor, batch: torch.Tensor, counts: torch.Tensor, cells: torch.Tensor,
    pbcs: torch.Tensor, cutoff: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(src, dst, cell_shifts, distances)`` of every molecule from vesin (float64)."""
    import vesin

    order = torch.argsort(batch, stable=True)  # molecules as contiguous segments
    p64 = pos[order].to(torch.float64).numpy()
    cells64, per = cells.to(torch.float64).numpy(), pbcs.numpy()
    calc = vesin.NeighborList(cutoff=cutoff, full_list=True)
    src, dst, sh, dist = [], [], [], []
    start = 0
    for b, m in enumerate(counts.tolist()):
        if m > 0:  # (one atom in a periodic cell has its own images as neighbours)
            periodic = per[b].tolist()
            box = cells64[b] if any(periodic) else np.zeros((3, 3))
            i, j, s, d = calc.compute(p64[start:start + m], box, periodic, quantities="ijSd")
            src.append(i.astype(np.int64) + start)
            dst.append(j.astype(np.int64) + start)
            sh.append(s.astype(np.int64))
            dist.append(d)
        start += m
    if not src:  # no atoms
        src, dst = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        sh, dist = [np.zeros((0, 3), np.int64)], [np.zeros(0)]
    back = order.numpy()  # segment position -> original atom index
    return (torch.from_numpy(back[np.concatenate(src)]), torch.from_numpy(back[np.concatenate(dst)]),
            torch.from_numpy(np.concatenate(sh)), torch.from_numpy(np.concatenate(dist)))


def _small_molecule_pairs(
    pos: torch.Tensor, batch: torch.Tensor, counts: torch.Tensor, cutoff: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All (i, j != i) pairs within each molecule closer than ``cutoff``."""
    dev = pos.device
    n = pos.shape[0]
    starts = torch.cumsum(counts, 0) - counts
    per_atom = counts[batch]
    total = int(per_atom.sum())
    center = torch.arange(n, device=dev).repeat_interleave(per_atom)
    seg = torch.cumsum(per_atom, 0) - per_atom
    j = starts[batch[center]] + torch.arange(total, device=dev) - seg[center]
    vec = pos[j] - pos[center]
    d2 = (vec * vec).sum(1)
    keep = (d2 < cutoff * cutoff) & (j != center)
    return center[keep], j[keep], torch.sqrt(d2[keep])


def _finish(
    src: torch.Tensor,
    dst: torch.Tensor,
    csh: torch.Tensor,
    dist: torch.Tensor,
    n: int,
    batch: torch.Tensor,
    cells: torch.Tensor,
    dtype: torch.dtype,
    cutoff: float,
    max_neighbors: int | None,
    overflow: str,
) -> NeighborList:
    """Apply the neighbour cap (error or drop-farthest), sort the edges by centre (stable:
    the torch paths already list them so) and build the NeighborList with its ``row_ptr``."""
    dev = src.device
    if src.numel() > 1 and not bool((src[1:] >= src[:-1]).all()):  # vesin's order
        o = torch.argsort(src, stable=True)
        src, dst, csh, dist = src[o], dst[o], csh[o], dist[o]
    per_center = torch.bincount(src, minlength=n)
    max_count = int(per_center.max()) if per_center.numel() else 0
    n_dropped = 0
    if max_neighbors is not None and max_count > max_neighbors:
        over = per_center > max_neighbors
        n_over = int(over.sum())
        n_dropped = int((per_center[over] - max_neighbors).sum())
        if overflow == "error":
            worst = int(torch.argmax(per_center))
            raise NeighborOverflowError(
                f"{n_over} atoms have more than max_neighbors={max_neighbors} neighbours "
                f"within {cutoff} Å (atom {worst} has {max_count}); {n_dropped} pairs would be dropped",
                hint="raise model.max_neighbors, lower model.cutoff, or set "
                "model.neighbor_overflow=drop to keep the nearest ones",
            )
        # Keep the nearest max_neighbors per centre: sort by (centre, distance).
        o = torch.argsort(dist, stable=True)
        o = o[torch.argsort(src[o], stable=True)]
        src, dst, csh, dist = src[o], dst[o], csh[o], dist[o]
        seg_start = torch.cumsum(per_center, 0) - per_center
        rank = torch.arange(src.numel(), device=dev) - seg_start[src]
        keep = rank < max_neighbors
        src, dst, csh, dist = src[keep], dst[keep], csh[keep], dist[keep]
        per_center = per_center.clamp_max(max_neighbors)
        log.warning(
            "neighbour cap %d: dropped %d pairs (farthest) on %d atoms", max_neighbors, n_dropped, n_over
        )
    # Cartesian shifts; only edges that cross a cell face have a non-zero lattice shift.
    shifts = torch.zeros(csh.shape[0], 3, dtype=cells.dtype, device=dev)
    cross = torch.nonzero(csh.any(dim=1)).flatten()
    if cross.numel():
        shifts[cross] = torch.einsum("ek,ekl->el", csh[cross].to(cells.dtype), cells[batch[src[cross]]])
    return NeighborList(
        edge_index=torch.stack([src, dst]),
        shifts=shifts.to(dtype),
        cell_shifts=csh,
        distances=dist.to(dtype),
        n_dropped=n_dropped,
        max_count=max_count,
        row_ptr=torch.nn.functional.pad(torch.cumsum(per_center, 0), (1, 0)),
    )


@torch.no_grad()
def all_pairs(
    positions: torch.Tensor,
    batch: torch.Tensor,
    n_molecules: int,
    cell: torch.Tensor | None = None,
    pbc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every ordered pair (i, j≠i) of each molecule, O(N²): ``(edge_index, shifts)``.

    Periodic structures use the minimum-image convention (valid when the cell is at least
    twice the interaction range). Edges are grouped by molecule and, within a molecule,
    row-major by centre (each centre has ``n_mol - 1`` consecutive edges).
    """
    dev = positions.device
    cells, pbcs = _as_batch_cells(n_molecules, cell, pbc, positions.dtype, dev)
    counts = torch.bincount(batch, minlength=n_molecules)
    starts = torch.cumsum(counts, 0) - counts
    srcs, dsts, shs = [], [], []
    for b in range(n_molecules):
        m = int(counts[b])
        if m < 2:
            continue
        a = torch.arange(m, device=dev)
        ii = a.repeat_interleave(m - 1)
        jj = a.repeat(m, 1)[~torch.eye(m, dtype=torch.bool, device=dev)]
        ii = ii + int(starts[b])
        jj = jj + int(starts[b])
        sh = torch.zeros(ii.numel(), 3, dtype=positions.dtype, device=dev)
        if bool(pbcs[b].any()):
            cellb = cells[b]
            d = positions[jj] - positions[ii]
            frac = d @ torch.linalg.pinv(cellb)
            k = -torch.round(frac) * pbcs[b].to(frac.dtype)
            sh = k @ cellb
        srcs.append(ii)
        dsts.append(jj)
        shs.append(sh)
    if not srcs:
        return torch.zeros(2, 0, dtype=torch.int64, device=dev), torch.zeros(0, 3, device=dev)
    return torch.stack([torch.cat(srcs), torch.cat(dsts)]), torch.cat(shs)
