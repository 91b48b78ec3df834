"""The data-read benchmark's reference streaming reader over our shard format (a torch
IterableDataset): seeded block shuffle, rank x worker split with equal per-rank counts,
exact mid-epoch resume (also with a new world size), mixing.

Not the trainer's reader: ``convergent train`` reads through
:class:`convergent.train.moldata.MoleculeSource` (``open_dataset`` random access, each
record copied once into :class:`~convergent.train.molcolumns.ColumnStore`'s flat arrays),
in a global batch plan that is a pure function of the seed and the step, so its resume is
exact from the checkpoint's step alone. This reader is what
:mod:`bench.dataio.read` measures as its ``convergent`` side; its block-shuffled order is
the one the benchmark's ``loose`` and ``convergent_random`` sides read in.

>>> ds = StreamingDataset("data/train", seed=0, shuffle=True, batch_size=32)
>>> loader = StreamingLoader(ds, batch_size=32, num_workers=2, collate_fn=collate)
>>> for epoch in range(start_epoch, epochs):
...     loader.set_epoch(epoch)
...     for batch in loader:
...         ...
...         ckpt = loader.state_dict()     # exact position; load_state_dict() to resume

See :mod:`bench.dataio.order` for the algorithm. ``batch_size`` given to the dataset
must equal the DataLoader's for exact resume with ``num_workers > 0``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import xxhash
from torch.utils.data import IterableDataset, get_worker_info

from bench.dataio import order as order_mod
from convergent.core.errors import DataError
from convergent.data.reader import Dataset, open_dataset

STATE_VERSION = 2  # 2: block shuffle by per-window Fisher-Yates (the order of 1 differs)
MAPPED_SHARDS = 3  # shards a reader keeps mapped at once (block shuffle reads 1-2 at a time)


def _dist_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _as_dataset(source: Any, cache: Any = None) -> Dataset:
    if isinstance(source, Dataset):
        return source
    if isinstance(source, (str, os.PathLike)):
        return open_dataset(source, cache=cache)
    raise DataError(f"cannot stream from a {type(source).__name__}; pass a dataset path or Dataset")


class _StreamBase(IterableDataset):
    """Split/resume machinery over an abstract epoch order of sample ids."""

    def __init__(self, *, seed: int, shuffle: bool, rank: int | None, world_size: int | None,
                 drop_last: bool, batch_size: int, transform: Callable[[dict], Any] | None,
                 prefetch_shards: int) -> None:
        super().__init__()
        self.seed, self.shuffle, self.drop_last = int(seed), bool(shuffle), bool(drop_last)
        self.batch_size = max(1, int(batch_size))
        self.transform = transform
        self.prefetch_shards = int(prefetch_shards)
        self._rank_arg, self._world_arg = rank, world_size
        self.rank, self.world_size = 0, 1
        self._resolve_world()
        self.epoch = 0
        self._start = 0  # global position consumed before this iteration (resume point)
        self._consumed = 0  # samples this rank yielded in-process (num_workers == 0)
        self._order_cache: tuple[int, np.ndarray] | None = None

    # ---- to implement
    def _epoch_ids(self, epoch: int) -> np.ndarray:  # ids of the whole epoch, in order
        raise NotImplementedError

    def _fetch(self, sample_id: int) -> dict[str, Any]:
        raise NotImplementedError

    def _fingerprint(self) -> str:
        raise NotImplementedError

    @property
    def total(self) -> int:
        """Samples in one epoch (all ranks together, before pad/drop)."""
        raise NotImplementedError

    # ---- world
    def _resolve_world(self) -> None:
        r, w = _dist_world()
        self.rank = r if self._rank_arg is None else int(self._rank_arg)
        self.world_size = w if self._world_arg is None else int(self._world_arg)
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise DataError(f"rank {self.rank} is outside world size {self.world_size}")

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != epoch:
            self._order_cache = (epoch, self._epoch_ids(epoch))
        return self._order_cache[1]

    # ---- public API
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (its shuffle). A different epoch than a loaded state's starts at 0."""
        self._resolve_world()
        if int(epoch) != self.epoch:
            self.epoch, self._start, self._consumed = int(epoch), 0, 0
        self._order(self.epoch)  # computed before DataLoader workers fork

    def __len__(self) -> int:
        """Samples this rank yields in the current iteration (equal on every rank)."""
        return order_mod.rank_count(self.total, self._start, self.world_size, self.drop_last)

    def rank_ids(self) -> np.ndarray:
        """Sample ids this rank yields in the current iteration, in order."""
        pos = order_mod.rank_positions(self.total, self._start, self.rank, self.world_size, self.drop_last)
        return self._order(self.epoch)[pos]

    def worker_ids(self, worker: int, num_workers: int) -> np.ndarray:
        """Sample ids DataLoader worker ``worker`` of ``num_workers`` yields, in order."""
        ids = self.rank_ids()
        return ids[order_mod.worker_slots(len(ids), worker, num_workers, self.batch_size)]

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        prefetcher = self._start_prefetch(wid, nw)
        in_process, transform = info is None, self.transform
        try:
            for recs in self._record_chunks(self._worker_chunks(wid, nw, 1 if prefetcher else None)):
                if transform is not None:
                    recs = [transform(r) for r in recs]
                if prefetcher is not None:
                    prefetcher.advance()
                if in_process:
                    for r in recs:
                        self._consumed += 1
                        yield r
                else:
                    yield from recs
        finally:
            if prefetcher is not None:
                prefetcher.stop()
            self._release_all()
        if in_process and self._consumed >= len(self):
            # a completed pass: the next one replays the epoch from its start
            self._start, self._consumed = 0, 0

    def _worker_chunks(self, worker: int, num_workers: int, step: int | None) -> Iterator[np.ndarray]:
        """The sample ids of :meth:`worker_ids`, computed chunk by chunk of ``step`` (default
        the batch size), so a short read costs no work over the whole epoch."""
        n, b = len(self), self.batch_size
        step = step or b
        order = self._order(self.epoch)
        for c in range(worker * b, n, max(1, num_workers) * b):
            pos = order_mod.rank_positions_slice(self.total, self._start, self.rank, self.world_size,
                                                 c, min(c + b, n))
            ids = order[pos]
            for k in range(0, len(ids), step):
                yield ids[k : k + step]

    def _release_all(self) -> None:
        """Unmap whatever this iteration mapped."""

    def _start_prefetch(self, worker: int, num_workers: int) -> Any:
        """A prefetcher for this worker's reads (with a cache tier), else None."""
        return None

    def _record_chunks(self, chunks: Iterator[np.ndarray]) -> Iterator[list[Any]]:
        """The decoded records of each chunk of sample ids, in order."""
        for ids in chunks:
            yield [self._fetch(sid) for sid in ids.tolist()]

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Exact position in the epoch.

        Args:
            consumed: samples this rank has consumed in the current iteration (the trainer
                knows: batches x batch size). Default: the count of samples yielded
                in-process (right for ``num_workers=0``; use :class:`StreamingLoader`
                to get it with workers).
        """
        self._resolve_world()
        k = self._consumed if consumed is None else int(consumed)
        position = min(self.total, self._start + k * self.world_size)
        return {
            "version": STATE_VERSION, "seed": self.seed, "epoch": self.epoch,
            "position": position, "total": self.total, "shuffle": self.shuffle,
            "fingerprint": self._fingerprint(), "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position; the world size may differ from the saved one."""
        if state.get("version") != STATE_VERSION:
            raise DataError(f"reader state version {state.get('version')!r} is not {STATE_VERSION}")
        if state.get("fingerprint") != self._fingerprint() or state.get("total") != self.total:
            raise DataError(
                "reader state belongs to a different dataset or selection of samples",
                hint="resume with the same dataset, indices and mixing weights",
            )
        if state.get("seed") != self.seed or state.get("shuffle") != self.shuffle:
            raise DataError(
                f"reader state was saved with seed={state.get('seed')} shuffle={state.get('shuffle')}, "
                f"this reader has seed={self.seed} shuffle={self.shuffle}"
            )
        self._resolve_world()
        self.epoch, self._start, self._consumed = int(state["epoch"]), int(state["position"]), 0
        self._order_cache = None


class StreamingDataset(_StreamBase):
    """Stream the records of one dataset (or a subset of its indices).

    Args:
        source: dataset directory or an open :class:`~convergent.data.reader.Dataset`.
        indices: global record indices to stream (default all), e.g. a split's train part.
        seed: shuffle seed; the order is a pure function of (seed, epoch).
        shuffle: block shuffle with shard locality (else index order).
        rank, world_size: default from ``torch.distributed`` if initialised, else 0 / 1.
        drop_last: drop the tail so ranks get equal counts (default: pad by wrapping).
        batch_size: the DataLoader batch size (needed for exact resume with workers).
        block_size: shuffle window, samples.
        transform: applied to each record dict in the worker (e.g. to tensors).
        cache: a :class:`~convergent.data.cache.ShardCache` or node-local directory.
        cache_bytes: budget when ``cache`` is a directory.
        prefetch_shards: shards copied into the cache ahead of the reader.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Dataset,
        indices: Sequence[int] | np.ndarray | None = None,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        batch_size: int = 1,
        block_size: int = 16384,
        transform: Callable[[dict], Any] | None = None,
        cache: Any = None,
        cache_bytes: int | None = None,
        prefetch_shards: int = 2,
    ) -> None:
        if cache is not None and not hasattr(cache, "get"):
            from convergent.data.cache import ShardCache

            cache = ShardCache(cache, budget_bytes=cache_bytes or 10 * 2**30)
        self.dataset = _as_dataset(source, cache)
        if cache is not None and self.dataset.cache is None:
            self.dataset = open_dataset(self.dataset.path, cache=cache)
        n = len(self.dataset)
        if indices is None:
            self.indices = np.arange(n, dtype=np.int64)
        else:
            self.indices = np.asarray(indices, dtype=np.int64).reshape(-1)
            if len(self.indices) and (self.indices.min() < 0 or self.indices.max() >= n):
                raise DataError(f"{self.dataset.path}: an index is outside 0..{n - 1}")
        self._shard_of = self.dataset.shard_of(self.indices) if len(self.indices) else np.zeros(0, np.int64)
        used, count = np.unique(self._shard_of, return_counts=True)
        for s, c in zip(used.tolist(), count.tolist(), strict=True):
            sh = self.dataset.shards[s]
            # a missing or truncated shard fails here; its index is read (and checked) on
            # first use, so a short read of a big dataset opens only the shards it reads
            sh.check_size()
            sh.populate = c >= 0.5 * sh.info.records
        self.block_size = int(block_size)
        self._mapped: dict[int, bool] = {}  # shards mapped by this process, oldest use first
        super().__init__(seed=seed, shuffle=shuffle, rank=rank, world_size=world_size,
                         drop_last=drop_last, batch_size=batch_size, transform=transform,
                         prefetch_shards=prefetch_shards)
        self._order(self.epoch)  # once here: DataLoader workers inherit it instead of each computing it

    @property
    def total(self) -> int:
        return len(self.indices)

    def epoch_positions(self, epoch: int) -> np.ndarray:
        """Permutation of ``range(len(indices))``: the epoch order as positions in ``indices``."""
        if not self.shuffle:
            return np.arange(len(self.indices), dtype=np.int64)
        return order_mod.block_shuffle(self._shard_of, self.seed, epoch, self.block_size)

    def _epoch_ids(self, epoch: int) -> np.ndarray:
        return self.indices[self.epoch_positions(epoch)]

    def _fetch(self, sample_id: int) -> dict[str, Any]:
        return self.dataset[sample_id]

    def _record_chunks(self, chunks: Iterator[np.ndarray]) -> Iterator[list[Any]]:
        # decoded shard by shard (one call per shard and chunk); at most MAPPED_SHARDS stay
        # mapped (the block shuffle reads one or two at a time), least recently used first out
        ds = self.dataset
        readers, starts, mapped = ds.shards, ds.starts, self._mapped
        for chunk in chunks:
            sh = ds.shard_of(chunk)
            local = chunk - starts[sh]
            first = int(sh[0])
            if sh[-1] == first and (sh == first).all():
                used = [first]
                out = readers[first].records(local.tolist())
            else:
                used = np.unique(sh).tolist()
                out: list[Any] = [None] * len(sh)
                for s in used:
                    pos = np.flatnonzero(sh == s)
                    for p, rec in zip(pos.tolist(), readers[s].records(local[pos].tolist()), strict=True):
                        out[p] = rec
            for s in used:
                mapped.pop(s, None)
                mapped[s] = True
            while len(mapped) > MAPPED_SHARDS:
                oldest = next(iter(mapped))
                readers[oldest].release()
                del mapped[oldest]
            yield out

    def _release_all(self) -> None:
        for s in self._mapped:
            self.dataset.shards[s].release()
        self._mapped.clear()

    def _fingerprint(self) -> str:
        h = xxhash.xxh3_64()
        h.update(self.indices.tobytes())
        for s in self.dataset.manifest.shards:
            h.update(f"{s.name}:{s.records}:{s.xxh3_64};".encode())
        return h.hexdigest()

    def _start_prefetch(self, worker: int, num_workers: int) -> Any:
        ds = self.dataset
        if ds.cache is None:
            return None
        ids = self.worker_ids(worker, num_workers)
        if len(ids) == 0:
            return None
        from convergent.data.cache import Prefetcher

        shard_seq = ds.shard_of(ids)
        return Prefetcher(ds.cache, ds, ids, shard_seq, ahead=self.prefetch_shards)


class MixedStreamingDataset(_StreamBase):
    """Weighted mixing of several datasets into one deterministic stream.

    Each position of an epoch of ``samples_per_epoch`` samples draws its source with
    probability proportional to ``weights`` (a pure function of seed and epoch); the k-th
    draw from a source takes the k-th sample of that source's own block-shuffled order
    (cycling when a small source is up-sampled). Split and resume work as for
    :class:`StreamingDataset`.
    """

    def __init__(
        self,
        sources: Sequence[str | os.PathLike[str] | Dataset | StreamingDataset],
        weights: Sequence[float],
        samples_per_epoch: int | None = None,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        batch_size: int = 1,
        block_size: int = 16384,
        transform: Callable[[dict], Any] | None = None,
    ) -> None:
        if len(sources) != len(weights) or not sources:
            raise DataError("give one weight per source (and at least one source)")
        self.streams = [
            s if isinstance(s, StreamingDataset)
            else StreamingDataset(s, seed=seed, shuffle=shuffle, block_size=block_size, rank=0, world_size=1)
            for s in sources
        ]
        self.weights = [float(w) for w in weights]
        if any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
            raise DataError(f"mixing weights {self.weights} must be >= 0 with a positive sum")
        self.lengths = [s.total for s in self.streams]
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self._total = int(samples_per_epoch) if samples_per_epoch is not None else int(sum(self.lengths))
        super().__init__(seed=seed, shuffle=shuffle, rank=rank, world_size=world_size,
                         drop_last=drop_last, batch_size=batch_size, transform=transform,
                         prefetch_shards=0)

    @property
    def total(self) -> int:
        return self._total

    def _epoch_ids(self, epoch: int) -> np.ndarray:
        try:
            src, k = order_mod.mix_choices(self.lengths, self.weights, self._total, self.seed, epoch)
        except ValueError as exc:
            raise DataError(f"cannot mix: {exc}") from None
        out = np.zeros(self._total, np.int64)
        for s, st in enumerate(self.streams):
            sel = src == s
            if not sel.any():
                continue
            # the k-th draw from source s takes its k-th sample, cycling through its epochs
            ks, n = k[sel], self.lengths[s]
            ep = ks // n
            local = np.empty(len(ks), np.int64)
            for e in np.unique(ep).tolist():
                m = ep == e
                local[m] = st.epoch_positions(int(epoch) * 1_000_003 + e)[ks[m] % n]
            out[sel] = self.offsets[s] + local
        return out

    def _fetch(self, sample_id: int) -> dict[str, Any]:
        s = int(np.searchsorted(self.offsets, sample_id, side="right")) - 1
        return self.streams[s].dataset[int(self.streams[s].indices[sample_id - self.offsets[s]])]

    def _fingerprint(self) -> str:
        h = xxhash.xxh3_64()
        for st, w in zip(self.streams, self.weights, strict=True):
            h.update(st._fingerprint().encode())
            h.update(repr(w).encode())
        h.update(str(self._total).encode())
        return h.hexdigest()


class StreamingLoader:
    """A torch DataLoader over a streaming dataset that knows how far it got.

    It counts the samples it returned, so :meth:`state_dict` is exact also with
    ``num_workers > 0``. The dataset's ``batch_size`` is set to the loader's.
    """

    def __init__(self, dataset: _StreamBase, batch_size: int = 1, num_workers: int = 0,
                 collate_fn: Callable[[list], Any] | None = None, **loader_kwargs: Any) -> None:
        from torch.utils.data import DataLoader

        if loader_kwargs.get("persistent_workers"):
            raise DataError(
                "StreamingLoader does not support persistent_workers=True",
                hint="persistent workers keep a stale copy of the epoch and resume point",
            )
        dataset.batch_size = max(1, int(batch_size))
        self.dataset, self.batch_size = dataset, dataset.batch_size
        if collate_fn is None:
            collate_fn = _list_collate
        self.loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                                 collate_fn=collate_fn, **loader_kwargs)
        self._consumed = 0

    def set_epoch(self, epoch: int) -> None:
        before = self.dataset.epoch
        self.dataset.set_epoch(epoch)
        if epoch != before:
            self._consumed = 0

    def __len__(self) -> int:
        return -(-len(self.dataset) // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        n = len(self.dataset)
        self._consumed = 0
        for batch in self.loader:
            self._consumed = min(n, self._consumed + self.batch_size)
            yield batch
        self.dataset._start, self.dataset._consumed, self._consumed = 0, 0, 0

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict(consumed=self._consumed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)
        self._consumed = 0


def _list_collate(batch: list) -> list:
    return batch
