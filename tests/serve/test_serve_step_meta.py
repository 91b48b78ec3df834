"""A step's metadata planned with numpy into preallocated buffers (one copy per step) equals
what the list-and-tensor construction it replaced built, for mixed prefill/decode batches."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from convergent.models.llama import PagedBatch, pad_groups  # noqa: E402
from convergent.models.llama_paged import decode_waste  # noqa: E402
from convergent.models.paged_meta import StepBuffers, plan_step  # noqa: E402


def _old_groups(ql, cl, tables, bs):
    """The construction before the step buffers (PagedBatch.prepare at 03afa08), on the
    CPU: Python lists per token, one ``torch.tensor`` per index list; the decode groups
    padded as the CPU pads them, :func:`decode_waste`)."""
    starts, off = [], 0
    for q in ql:
        starts.append(off)
        off += q
    dec, fresh, chunked = [], [], []
    for i, (q, c) in enumerate(zip(ql, cl, strict=True)):
        (dec if q == 1 and c > 1 else fresh if q == c else chunked).append(i)
    nblk = [-(-cl[i] // bs) for i in dec]
    decode = []
    for g in pad_groups(nblk, max_waste=decode_waste(torch.device("cpu"))):
        seqs = [dec[j] for j in g]
        width = nblk[g[0]]
        blocks = []
        for i in seqs:
            bt = tables[i][:width]
            blocks.extend(bt)
            blocks.extend([0] * (width - len(bt)))
        ctx = torch.tensor([cl[i] for i in seqs])
        bias = torch.zeros(len(seqs), width * bs)
        bias.masked_fill_(torch.arange(width * bs)[None, :] >= ctx[:, None], float("-inf"))
        decode.append((torch.tensor([starts[i] for i in seqs]), torch.tensor(blocks), bias, width))
    lens = [ql[i] for i in fresh]
    prefill = []
    for g in pad_groups(lens):
        seqs = [fresh[j] for j in g]
        length = lens[g[0]]
        gather, valid, rows = [], [], []
        for r, i in enumerate(seqs):
            n, s0 = ql[i], starts[i]
            gather.extend(range(s0, s0 + n))
            gather.extend([0] * (length - n))
            valid.extend(range(r * length, r * length + n))
            rows.extend(range(s0, s0 + n))
        prefill.append((torch.tensor(gather), torch.tensor(valid), torch.tensor(rows), length))
    slots = {}
    for i in chunked:
        pos = torch.arange(cl[i])
        bt = torch.tensor(tables[i], dtype=torch.int64)
        slots[i] = bt[pos // bs] * bs + pos % bs
    return starts, decode, prefill, chunked, slots


def _mixed_step(rng, n, bs):
    """A step of ``n`` sequences: decodes (short and long contexts), fresh prompts and
    chunks after a cached prefix; block tables from one shuffled pool (some a block longer
    than the context needs, as a table grown ahead is)."""
    pool = list(range(4000))
    rng.shuffle(pool)
    ql, cl, tables, pos, slots = [], [], [], [], []
    for _ in range(n):
        kind = rng.choice(["decode", "decode", "fresh", "chunk", "one"])
        c = rng.choice([2, 5, 16, 17, 40, 90, 300]) if kind != "one" else 1
        q = {"decode": 1, "fresh": c, "one": 1}.get(kind, max(1, c // 3))
        nb = -(-c // bs) + rng.choice([0, 0, 1])
        t = [pool.pop() for _ in range(nb)]
        ql.append(q)
        cl.append(c)
        tables.append(t)
        for p in range(c - q, c):
            pos.append(p)
            slots.append(t[p // bs] * bs + p % bs)
    return pos, slots, ql, cl, tables


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_step_buffers_equal_the_list_construction(seed):
    rng = random.Random(seed)
    bs = 4 if seed != 2 else 16
    bufs = StepBuffers("cpu", capacity=64)  # small: the steps outgrow it
    for step in range(4):
        pos, slots, ql, cl, tables = _mixed_step(rng, rng.randint(1, 40), bs)
        ids = [rng.randrange(1000) for _ in pos]
        b = PagedBatch.build(bufs, pos, slots, ql, cl, tables, bs, extras=[ids, [len(pos) - 1]])
        starts, decode, prefill, chunked, cslots = _old_groups(ql, cl, tables, bs)
        assert b.positions.tolist() == pos and b.slot_mapping.tolist() == slots, step
        assert [e.tolist() for e in b.extras] == [ids, [len(pos) - 1]]
        assert b.starts == starts and b.chunked == chunked
        assert len(b.decode_groups) == len(decode) and len(b.prefill_groups) == len(prefill)
        for g, (rows, blocks, bias, width) in zip(b.decode_groups, decode, strict=True):
            assert g.width == width
            assert torch.equal(g.rows, rows) and torch.equal(g.blocks, blocks)
            assert torch.equal(g.bias, bias)
        for g, (gather, valid, rows, length) in zip(b.prefill_groups, prefill, strict=True):
            assert g.length == length
            assert torch.equal(g.gather, gather) and torch.equal(g.valid, valid)
            assert torch.equal(g.rows, rows)
        assert set(b.chunk_slots) == set(cslots)
        for i, s in cslots.items():
            assert torch.equal(b.seq_slots(i), s)
    assert bufs.grows >= 1 and bufs.uploads == 4


def test_decode_batch_for_the_block_table_kernels():
    rng = random.Random(5)
    bs = 4
    pos, slots, ql, cl, tables = _mixed_step(rng, 30, bs)
    plan = plan_step(ql, cl, tables, bs, gather_decode=False)
    assert not plan.decode_groups
    dec = [i for i, (q, c) in enumerate(zip(ql, cl, strict=True)) if q == 1 and c > 1]
    rows, tab, ctx = plan.decode_batch
    starts = np.cumsum([0, *ql[:-1]])
    assert rows.tolist() == [int(starts[i]) for i in dec]
    assert ctx.tolist() == [cl[i] for i in dec]
    width = max(-(-cl[i] // bs) for i in dec)
    assert tab.shape == (len(dec), width)
    for r, i in enumerate(dec):
        need = -(-cl[i] // bs)
        assert tab[r, :need].tolist() == tables[i][:need]
    b = PagedBatch.build(StepBuffers("cpu"), pos, slots, ql, cl, tables, bs, backend="triton")
    assert b.decode is not None and not b.decode_groups
    assert torch.equal(b.decode.tables, torch.from_numpy(tab)) and b.decode.width == width
    # a step without decodes has no decode batch
    assert plan_step([3], [3], [[7]], bs, gather_decode=False).decode_batch is None


def test_upload_writes_one_buffer_and_returns_shaped_views():
    bufs = StepBuffers("cpu", capacity=8)
    a, b, c = bufs.upload([[1, 2, 3], np.arange(6).reshape(2, 3), []])
    assert a.tolist() == [1, 2, 3] and b.tolist() == [[0, 1, 2], [3, 4, 5]] and c.numel() == 0
    assert a.dtype == torch.int64 and b.data_ptr() == a.data_ptr() + 3 * 8  # back to back
    assert bufs.grows == 1 and bufs.capacity >= 9
