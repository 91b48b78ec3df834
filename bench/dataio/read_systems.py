"""The systems bench/dataio/read.py compares: data generation (log-normal record sizes,
loose files), building each system's copy (pack, export, optimize) and the DataLoader that
reads each one in the same shuffled order (see bench/dataio/read.py). Our shards are read
two ways: by the reference streaming reader (bench/dataio/stream.py) and by
``open_dataset``'s random access, the access the trainer's reader
(train/moldata.MoleculeSource) makes."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from bench.dataio.read_os import RssSampler

SYSTEMS = ("loose", "convergent", "convergent_random", "convergent_cached", "webdataset", "mds",
           "litdata", "ideal")
PEERS = ("webdataset", "mds", "litdata")
SHARD_BYTES = 128 * 2**20
MEDIAN_BYTES = 4096
SIGMA = 0.8  # log-normal shape


# ---------------------------------------------------------------------------- data


def record_sizes(n: int, seed: int) -> np.ndarray:
    """Log-normal payload sizes, bytes (median 4 KiB, clipped to 64 B .. 1 MiB)."""
    rng = np.random.default_rng(seed)
    s = np.exp(rng.normal(np.log(MEDIAN_BYTES), SIGMA, n))
    return np.clip(s, 64, 2**20).astype(np.int64)


def loose_rel(i: int) -> str:
    return f"{i // 1000:04d}/{i:07d}.bin"


def generate(data: Path, n: int, seed: int) -> dict:
    """Loose files ``data/loose/DDDD/NNNNNNN.bin``; skipped if already made for (n, seed).

    Record ``i`` depends only on (i, seed), so a larger run reuses the files of a smaller
    one (a file of the right size is kept) and files past ``n`` are removed.
    """
    stamp = data / "loose.json"
    if stamp.exists() and json.loads(stamp.read_text()) == {"records": n, "seed": seed}:
        return {"generated": False}
    stamp.unlink(missing_ok=True)
    t0 = time.perf_counter()
    sizes = record_sizes(n, seed)
    rng = np.random.default_rng(seed + 1)
    pool = rng.bytes(4 * 2**20 + 2**20)
    offs = rng.integers(0, 4 * 2**20, n)
    kept = 0
    for i in range(n):
        p = data / "loose" / loose_rel(i)
        if i % 1000 == 0:
            p.parent.mkdir(parents=True, exist_ok=True)
            have = {e.name: e.stat().st_size for e in os.scandir(p.parent)}
        if have.get(p.name) == sizes[i]:
            kept += 1
            continue
        # random bytes, a distinct window of a random pool per record (incompressible)
        p.write_bytes(i.to_bytes(8, "little") + pool[offs[i] : offs[i] + int(sizes[i]) - 8])
    for d in (data / "loose").iterdir():  # directories of records >= n (a smaller run)
        if d.is_dir() and int(d.name) * 1000 >= n:
            shutil.rmtree(d)
    last = data / "loose" / loose_rel(n - 1)
    for e in os.scandir(last.parent):
        if e.name > last.name:
            os.unlink(e.path)
    stamp.write_text(json.dumps({"records": n, "seed": seed}))
    return {"generated": True, "seconds": time.perf_counter() - t0, "bytes": int(sizes.sum()), "kept": kept}


def build(system: str, data: Path, n: int, workers: int) -> float:
    """Build one system's copy of the loose files; returns seconds (0 if already built)."""
    out = data / system
    stamp = data / f"{system}.json"
    want = json.loads((data / "loose.json").read_text())
    if stamp.exists() and out.exists():
        have = json.loads(stamp.read_text())
        if {k: have.get(k) for k in want} == want:
            return float(have.get("seconds", 0.0))  # built earlier: report that build's time
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    if system == "convergent":
        from convergent.data.pack import pack_directory

        pack_directory(data / "loose", out, schema="bytes", shard_bytes=SHARD_BYTES, compression="none")
    elif system == "webdataset":
        from convergent.data.export import export_webdataset

        export_webdataset(data / "convergent", out, shard_bytes=SHARD_BYTES)
    elif system == "mds":
        from convergent.data.export import export_mds

        export_mds(data / "convergent", out, shard_bytes=SHARD_BYTES)
    elif system == "litdata":
        from litdata import optimize

        files = [str(data / "loose" / loose_rel(i)) for i in range(n)]
        optimize(fn=_litdata_item, inputs=files, output_dir=str(out), chunk_bytes=SHARD_BYTES,
                 num_workers=max(1, workers), verbose=False, start_method="fork")
    seconds = time.perf_counter() - t0
    stamp.write_text(json.dumps(dict(want, seconds=seconds)))
    return seconds


def _litdata_item(path: str) -> dict:
    p = Path(path)
    return {"key": f"{p.parent.name}/{p.name}", "payload": p.read_bytes()}


# ---------------------------------------------------------------------------- readers


def _payloads(batch: list) -> list:
    return batch


def loose_order_file(data: Path, seed: int) -> Path:
    return data / f"loose-order-seed{seed}.npy"


def write_loose_order(data: Path, seed: int, batch: int) -> Path:
    """The record order of ``convergent``'s reader for ``seed`` (one rank), saved for the
    loose-file and ``convergent_random`` sides so that they read the same records in the
    same order. Sample id ``i`` of the packed dataset is loose file ``i``
    (``pack_directory`` packs sorted paths)."""
    from bench.dataio.stream import StreamingDataset

    ds = StreamingDataset(data / "convergent", seed=seed, shuffle=True, batch_size=batch,
                          rank=0, world_size=1)
    out = loose_order_file(data, seed)
    np.save(out, ds.rank_ids().astype(np.int64))
    return out


def _same_order(data: Path, seed: int, n: int) -> list[int]:
    """Ours' block-shuffled order (computed once by the driver, loaded here)."""
    order = np.load(loose_order_file(data, seed)).tolist()
    if len(order) != n:
        raise SystemExit(f"{loose_order_file(data, seed)}: {len(order)} ids for {n} records")
    return order


def make_loader(system: str, data: Path, batch: int, workers: int, seed: int,
                loose_order: str = "same"):
    """A DataLoader yielding lists of payload bytes, built like a user of that system would."""
    from torch.utils.data import DataLoader, Dataset

    common = {"batch_size": batch, "num_workers": workers, "collate_fn": _payloads}
    if workers:
        common["persistent_workers"] = False
    if system == "loose":
        files = sorted(str(p) for p in (data / "loose").rglob("*.bin"))

        class Files(Dataset):
            def __len__(self) -> int:
                return len(files)

            def __getitem__(self, i: int) -> bytes:
                with open(files[i], "rb") as fh:
                    return fh.read()

        import torch

        if loose_order == "full":  # the DataLoader idiom: a full random permutation
            return DataLoader(Files(), shuffle=True,
                              generator=torch.Generator().manual_seed(seed), **common)
        return DataLoader(Files(), sampler=_same_order(data, seed, len(files)), **common)
    if system == "convergent_random":
        # the trainer's access: open_dataset random access, record by record (map-style),
        # in ours' block-shuffled order (the loose side's sampler)
        from convergent.data.reader import open_dataset

        store = open_dataset(data / "convergent")  # shards mapped lazily, per worker process

        class Records(Dataset):
            def __len__(self) -> int:
                return len(store)

            def __getitem__(self, i: int) -> bytes:
                return store[i]["payload"]

        return DataLoader(Records(), sampler=_same_order(data, seed, len(store)), **common)
    if system == "convergent":
        from bench.dataio.stream import StreamingDataset

        ds = StreamingDataset(data / "convergent", seed=seed, shuffle=True, batch_size=batch,
                              rank=0, world_size=1, transform=lambda r: r["payload"])
        return DataLoader(ds, **common)
    if system == "convergent_cached":
        from bench.dataio.stream import StreamingDataset
        from convergent.data.cache import ShardCache
        from convergent.data.manifest import read_manifest

        cache_dir = data / "node-local-cache"
        shutil.rmtree(cache_dir, ignore_errors=True)
        m = read_manifest(data / "convergent")
        budget = max(m.bytes // 2, 3 * max(s.bytes for s in m.shards))
        ds = StreamingDataset(data / "convergent", seed=seed, shuffle=True, batch_size=batch,
                              rank=0, world_size=1, transform=lambda r: r["payload"],
                              cache=ShardCache(cache_dir, budget_bytes=budget), prefetch_shards=1)
        return DataLoader(ds, **common)
    if system == "webdataset":
        import webdataset as wds

        urls = [str(data / "webdataset" / n) for n in (data / "webdataset" / "shards.txt").read_text().split()]
        ds = wds.WebDataset(urls, shardshuffle=len(urls), seed=seed, empty_check=False).shuffle(1000).to_tuple("bin")
        ds = ds.map(lambda t: t[0])
        return DataLoader(ds, **common)
    if system == "mds":
        from streaming import StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()

        class Payload(StreamingDataset):
            def __getitem__(self, i: int) -> bytes:
                return super().__getitem__(i)["payload"]

        ds = Payload(local=str(data / "mds"), shuffle=True, shuffle_seed=seed, batch_size=batch)
        return DataLoader(ds, **common)
    if system == "litdata":
        from litdata import StreamingDataset

        class Payload(StreamingDataset):
            def __getitem__(self, i):  # noqa: ANN001
                return bytes(super().__getitem__(i)["payload"])  # litdata gives a memoryview

        ds = Payload(input_dir=str(data / "litdata"), shuffle=True, seed=seed)
        return DataLoader(ds, **common)
    if system == "ideal":
        return DataLoader(in_memory_payloads(data, batch, seed), **common)
    raise SystemExit(f"unknown system {system}")


def in_memory_payloads(data: Path, batch: int, seed: int):
    """The ``ideal`` system's dataset: payloads of the generated sizes in a shuffled order,
    copied out of one in-memory buffer (no files); chunks of ``batch`` go round-robin to
    the DataLoader workers like a storage reader's."""
    from torch.utils.data import IterableDataset, get_worker_info

    n = json.loads((data / "loose.json").read_text())["records"]
    sizes = record_sizes(n, seed)[np.random.default_rng(seed).permutation(n)].tolist()
    buf = np.random.default_rng(seed + 1).bytes(2**20)

    class InMemoryPayloads(IterableDataset):
        def __iter__(self):
            info = get_worker_info()
            w, k = (0, 1) if info is None else (info.id, info.num_workers)
            for i, size in enumerate(sizes):
                if (i // batch) % k == w:
                    yield buf[:size]

    return InMemoryPayloads()



def read_once(system: str, data: Path, batch: int, workers: int, seed: int, limit: int | None,
              sample_memory: bool = True, loose_order: str = "same") -> dict:
    """Read every sample once; returns the measurements."""
    import hashlib

    sampler = RssSampler() if sample_memory else None
    t0 = time.perf_counter()
    loader = make_loader(system, data, batch, workers, seed, loose_order)
    first = None
    n = nbytes = 0
    ids = hashlib.blake2b(digest_size=8)  # the record ids read, in order (first 8 bytes)
    for b in loader:
        if first is None:
            first = time.perf_counter() - t0
        n += len(b)
        nbytes += sum(len(x) for x in b)
        for x in b:
            ids.update(bytes(x[:8]))
        if limit and n >= limit:
            break
    dt = time.perf_counter() - t0
    if sampler is None:
        return {"samples": n, "bytes": nbytes}
    sampler.stop()
    return {
        "samples": n, "bytes": nbytes, "seconds": dt, "order_digest": ids.hexdigest(),
        "samples_per_s": n / dt, "MB_per_s": nbytes / dt / 1e6,
        "time_to_first_batch_s": first,
        # (ru_maxrss is not used: Linux keeps the parent's high-water mark across exec)
        "peak_rss_main_MiB": sampler.peak_main / 2**20,
        "peak_rss_tree_MiB": sampler.peak_tree / 2**20,
        "peak_private_tree_MiB": sampler.peak_private_tree / 2**20,
    }


