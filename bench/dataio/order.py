"""Pure functions that decide which sample goes where: epoch order, rank and worker splits
(of :mod:`bench.dataio.stream`, the data-read benchmark's reference streaming reader).

The epoch order is a *block shuffle* with shard locality, a pure function of
``(seed, epoch)``: the shards are permuted, their samples laid out shard after shard, and
the samples inside each window of ``block_size`` consecutive positions are permuted. A
reader therefore touches about ``1 + block_size / shard_records`` shards at a time.

Positions of the epoch order are dealt to ranks round-robin starting at a global
position ``start`` (the number of samples all ranks together consumed before a resume):
rank ``r`` of ``W`` gets positions ``start + r + j*W``. Every rank gets the same count
``ceil((M - start) / W)`` (``pad``: positions past the end wrap to the start of the
order) or ``floor(...)`` (``drop``), so DDP never hangs on uneven data. Because the split
only depends on ``start``, a resume may use a different world size and still sees every
remaining sample exactly once.

Inside a rank, samples are dealt to DataLoader workers in chunks of ``batch_size``
(chunk ``c`` to worker ``c % K``); the DataLoader's round-robin over workers then yields
the rank's samples in exactly the rank order, so "k samples consumed" is a prefix.
"""

from __future__ import annotations

import numpy as np


def _rng(seed: int, epoch: int, stream: int = 0) -> np.random.Generator:
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, int(epoch) & 0xFFFFFFFF, 0xC0DA, stream])


def block_shuffle(
    group: np.ndarray, seed: int, epoch: int, block_size: int, stream: int = 0
) -> np.ndarray:
    """Permutation of ``range(len(group))`` keeping samples of one group (shard) together.

    Args:
        group: shard number of each sample (any ints).
        seed, epoch: the permutation is a pure function of these (and ``stream``).
        block_size: samples are shuffled inside windows of this many positions.
    """
    group = np.asarray(group, np.int64)
    m = len(group)
    if m == 0:
        return np.zeros(0, np.int64)
    rng = _rng(seed, epoch, stream)
    if np.all(group[1:] >= group[:-1]):  # the usual case (indices in shard order): O(m)
        starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
        sizes = np.diff(np.r_[starts, m])
        perm = rng.permutation(len(starts))
        # the runs of samples of each shard, concatenated in the permuted shard order
        run_start = np.repeat(starts[perm] - np.r_[0, np.cumsum(sizes[perm])[:-1]], sizes[perm])
        laid_out = run_start + np.arange(m, dtype=np.int64)
    else:
        n_groups, inv = len(np.unique(group)), np.unique(group, return_inverse=True)[1]
        laid_out = np.argsort(rng.permutation(n_groups)[inv], kind="stable")  # shard by shard
    bs = max(1, int(block_size))
    # permute inside each window of bs positions (Fisher-Yates per row: no sort)
    full = (m // bs) * bs
    if full:
        rng.permuted(laid_out[:full].reshape(-1, bs), axis=1, out=laid_out[:full].reshape(-1, bs))
    laid_out[full:] = rng.permutation(laid_out[full:])
    return laid_out


def rank_count(total: int, start: int, world_size: int, drop_last: bool) -> int:
    """Samples each rank gets from position ``start`` of an epoch of ``total`` samples."""
    remaining = max(0, total - start)
    if total == 0:
        return 0
    return remaining // world_size if drop_last else -(-remaining // world_size)


def rank_positions(total: int, start: int, rank: int, world_size: int, drop_last: bool) -> np.ndarray:
    """Epoch positions (indices into the epoch order) of ``rank``, in its reading order.

    Positions past ``total`` (padding) wrap around to the beginning of the order.
    """
    return rank_positions_slice(total, start, rank, world_size, 0, rank_count(total, start, world_size, drop_last))


def rank_positions_slice(total: int, start: int, rank: int, world_size: int, lo: int, hi: int) -> np.ndarray:
    """Entries ``lo:hi`` of :func:`rank_positions` (a chunk, without the whole array)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    pos = start + rank + np.arange(lo, hi, dtype=np.int64) * world_size
    return pos % total if total else pos


def worker_slots(n: int, worker: int, num_workers: int, batch_size: int) -> np.ndarray:
    """Indices ``j < n`` of a rank's sequence read by DataLoader worker ``worker``.

    Chunks of ``batch_size`` go round-robin to the workers, which matches the order in
    which a torch DataLoader (``in_order=True``) returns their batches.
    """
    if num_workers <= 1:
        return np.arange(n, dtype=np.int64)
    b = max(1, int(batch_size))
    first = np.arange(worker * b, n, num_workers * b, dtype=np.int64)  # its chunks' starts
    out = (first[:, None] + np.arange(b, dtype=np.int64)).ravel()
    return out[: np.searchsorted(out, n)]  # the last chunk may be short


def mix_choices(lengths: list[int], weights: list[float], total: int, seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """For weighted mixing: which source each of ``total`` positions draws from, and the
    per-source running count (the k-th draw from a source takes its k-th sample, cycling).
    """
    w = np.asarray(weights, np.float64)
    if len(w) == 0 or np.any(w < 0) or w.sum() <= 0:
        raise ValueError("mixing weights must be non-negative with a positive sum")
    w = w / w.sum()
    rng = _rng(seed, epoch, 0x313)
    src = rng.choice(len(w), size=total, p=w).astype(np.int64)
    for s, n in enumerate(lengths):
        if n == 0 and np.any(src == s):
            raise ValueError(f"mixing source {s} is empty but has a positive weight")
    k = np.zeros(total, np.int64)
    for s in range(len(w)):
        sel = src == s
        k[sel] = np.arange(int(sel.sum()))
    return src, k
