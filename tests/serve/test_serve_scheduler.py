"""Schedulers and the block manager without a model: state + budgets in, batches out."""

from __future__ import annotations

import random

import pytest

from convergent.serve.costs import CostTable
from convergent.serve.kv_cache import BlockManager, blocks_for_budget
from convergent.serve.scheduler import (
    Request,
    SchedulerConfig,
    TDPipeScheduler,
    make_scheduler,
    predicted_peak_blocks,
    predicted_peak_tokens,
)

COSTS = CostTable([2e-3, 2e-4, 1e-7, 5e-6], [1e-3, 2e-4], 1e-4, 0.0, [2, 2], "test")


def _drive(sched, reqs, rng=None, max_steps=200_000):
    """Run a scheduler to completion with fake tokens, up to `depth` batches in flight,
    completing them in FIFO order; checks KV invariants after every step."""
    for r in reqs:
        sched.add(r)
    inflight, steps, batches = [], 0, []
    while sched.has_unfinished() or inflight:
        steps += 1
        assert steps < max_steps, "scheduler did not terminate"
        while len(inflight) < sched.depth:
            b = sched.schedule()
            if b is None:
                break
            rids = [it.rid for it in b.items]
            assert len(rids) == len(set(rids)), "a request twice in one micro-batch"
            for it in b.items:  # every token computed has a KV slot
                assert sched.bm.lengths[it.rid] >= it.start + it.n
                assert len(sched.bm.tables[it.rid]) * sched.bm.block_size >= it.start + it.n
            assert sched.bm.num_used <= sched.bm.num_blocks
            sched.bm.check()
            inflight.append(b)
            batches.append(b)
        if not inflight:
            assert sched.resolve_stall() is not None
            continue
        b = inflight.pop(0)
        toks = {it.rid: (it.rid * 7 + it.start + it.n) % 250 for it in b.items if it.sample}
        sched.complete(b, toks)
        sched.bm.check()
    return batches


def _reqs(n, seed=0, max_in=60, max_out=40, predict="oracle"):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        n_in, n_out = rng.randint(1, max_in), rng.randint(1, max_out)
        pred = n_out if predict == "oracle" else 20
        out.append(Request(i, [rng.randrange(250) for _ in range(n_in)], n_out, predicted_len=pred))
    return out


def test_block_manager_allocates_frees_and_never_overcommits():
    bm = BlockManager(10, 4)
    assert bm.grow(1, 9) == bm.tables[1] and len(bm.tables[1]) == 3
    assert bm.slots(1, 0, 9)[4] == bm.tables[1][1] * 4
    bm.grow(1, 12)  # still 3 blocks
    assert bm.num_used == 3
    bm.grow(2, 28)
    assert bm.num_free == 0 and not bm.can_grow(1, 13)
    with pytest.raises(MemoryError):
        bm.grow(3, 1)
    bm.free(1)
    assert bm.num_free == 3 and bm.peak_used == 10
    bm.check()
    assert blocks_for_budget(1000, 10, 4) == 25


def test_predicted_peak_tokens():
    # two sequences of length 10: one ends after 2 tokens, the other after 8
    # step 2: 12 + 12 = 24; step 8: 18 -> peak 24
    assert predicted_peak_tokens([(10, 2), (10, 8)]) == 24
    # (100, 1) and (1, 50): step 1 -> 101 + 2 = 103; step 50 -> 51
    assert predicted_peak_tokens([(100, 1), (1, 50)]) == 103
    assert predicted_peak_tokens([]) == 0
    assert predicted_peak_tokens([(5, 3)]) == 8


def test_predicted_peak_blocks_matches_step_by_step_count():
    assert predicted_peak_blocks([(10, 2), (10, 8)], 4) == 6  # 24 tokens, 3 + 3 blocks
    assert predicted_peak_blocks([], 4) == 0
    rng = random.Random(3)
    for _ in range(50):
        ents = [(rng.randint(1, 60), rng.randint(1, 40)) for _ in range(rng.randint(1, 12))]
        brute = max(
            sum(-(-(n + m) // 16) for n, rem in ents if rem >= m)
            for m in range(max(r for _, r in ents) + 1)
        )
        assert predicted_peak_blocks(ents, 16) == brute


@pytest.mark.parametrize("name", ["sequential", "interleaved", "tdpipe"])
@pytest.mark.parametrize("blocks", [400, 40])
def test_schedulers_finish_everything_within_budget(name, blocks):
    cfg = SchedulerConfig(kind=name, max_num_seqs=16, max_batched_tokens=128)
    bm = BlockManager(blocks, 4)
    sched = make_scheduler(cfg, bm, 2, COSTS, ignore_eos=True)
    reqs = _reqs(60, seed=blocks)
    _drive(sched, reqs)
    assert all(r.state == "finished" and r.finish_reason == "length" for r in reqs)
    assert all(len(r.output) == r.max_tokens for r in reqs)
    assert bm.num_used == 0 and bm.peak_used <= blocks
    if blocks == 40 and name != "tdpipe":
        assert sched.num_preemptions > 0  # the tight budget forces recompute


def test_preempted_requests_resume_with_their_tokens():
    cfg = SchedulerConfig(kind="interleaved", max_num_seqs=8, max_batched_tokens=64)
    sched = make_scheduler(cfg, BlockManager(12, 4), 2, ignore_eos=True)
    reqs = _reqs(20, seed=3, max_in=10, max_out=20)
    batches = _drive(sched, reqs)
    assert sched.num_preemptions > 0
    recomputed = [it for b in batches for it in b.items if it.start == 0 and it.n > 1]
    # a preempted request is recomputed from token 0 over prompt + generated tokens
    assert any(it.n > len(sched.requests[it.rid].prompt) for it in recomputed)
    for r in reqs:
        assert r.output == [(r.rid * 7 + len(r.prompt) + i) % 250 for i in range(r.max_tokens)]


def test_chunked_prefill_respects_token_budget():
    cfg = SchedulerConfig(
        kind="interleaved", max_num_seqs=64, max_batched_tokens=32, chunked_prefill=True
    )
    sched = make_scheduler(cfg, BlockManager(500, 4), 2, ignore_eos=True)
    batches = _drive(sched, _reqs(30, seed=5, max_in=100, max_out=10))
    assert all(b.num_tokens <= 32 for b in batches)
    assert any(
        it.n < len(sched.requests[it.rid].prompt) and it.n > 1 for b in batches for it in b.items
    )  # some prompt was split


def test_unchunked_interleaved_mixes_prefill_and_decode():
    cfg = SchedulerConfig(kind="interleaved", max_num_seqs=64, max_batched_tokens=256)
    sched = make_scheduler(cfg, BlockManager(500, 4), 2, ignore_eos=True)
    batches = _drive(sched, _reqs(30, seed=6))
    assert any(b.kind == "mixed" for b in batches)


def test_tdpipe_separates_prefill_and_decode_and_balances():
    cfg = SchedulerConfig(kind="tdpipe", max_num_seqs=64, max_batched_tokens=256)
    bm = BlockManager(300, 4)
    sched = make_scheduler(cfg, bm, 2, COSTS, ignore_eos=True)
    batches = _drive(sched, _reqs(80, seed=7))
    assert {b.kind for b in batches} <= {"prefill", "decode"}  # never mixed
    assert sched.num_preemptions == 0  # oracle predictions keep the peak under budget
    # work stealing: consecutive decode micro-batches stay balanced (+-1) while full
    dec = [len(b.items) for b in batches if b.kind == "decode"]
    pairs = [(a, b) for a, b in zip(dec, dec[1:], strict=False) if a >= 8 and b >= 8]
    assert pairs and sum(abs(a - b) <= 2 for a, b in pairs) / len(pairs) > 0.8
    assert sched.mode_switches >= 2  # went back to prefill at least once


def test_tdpipe_admission_bounded_by_predicted_peak():
    cfg = SchedulerConfig(max_num_seqs=256, max_batched_tokens=10_000, tdpipe_memory_fraction=1.0)
    bm = BlockManager(100, 4)  # 400 tokens
    sched = TDPipeScheduler(cfg, bm, 2, COSTS)
    for i in range(10):  # each: 20 prompt + 40 predicted output = 60 tokens peak
        sched.add(Request(i, [1] * 20, 40, predicted_len=40))
    b = sched.schedule()
    admitted = len(b.items)
    assert b.kind == "prefill"
    assert 5 <= admitted <= 6  # 6 * 60 = 360 tokens (+ slack) <= 400 < 7 * 60


def test_tdpipe_switch_rule_uses_intensity():
    # 256-token micro-batches: 40 prompts of 50 tokens make a round of 8 prefill batches
    cfg = SchedulerConfig(max_num_seqs=64, max_batched_tokens=256)
    # a cost table with a large fixed cost per micro-batch: small decode batches are slow
    costs = CostTable([5e-3, 1e-4, 0.0, 0.0], [0.0, 0.0], 0.0, 0.0, [2, 2], "test")
    sched = TDPipeScheduler(cfg, BlockManager(10_000, 4), 2, costs)
    for i in range(2):  # two sequences decoding
        r = Request(i, [1] * 10, 100, predicted_len=100)
        sched._admit_req(r)
        sched.bm.grow(r.rid, 11)
        r.output.append(1)
        r.num_computed = 10
    many = [Request(100 + i, [1] * 50, 10, predicted_len=10) for i in range(40)]
    one_tiny = [Request(200, [1] * 2, 10, predicted_len=10)]
    # refilling with 40 requests multiplies decode throughput: decode intensity is low
    assert sched._decode_intensity(many) < 0.2
    # a big prefill round is mostly useful work; a tiny one is mostly bubble
    assert sched._prefill_intensity(many) > 0.8 > sched._prefill_intensity(one_tiny)
    sched.prefill_mode = False
    for r in many:
        sched.add(r)
    sched.update_mode()
    assert sched.prefill_mode  # switch: 2 sequences decoding, 40 waiting
    # with a cost table where batching does not help, one tiny candidate is not worth it
    flat = CostTable([0.0, 1e-3, 0.0, 0.0], [0.0, 0.0], 0.0, 0.0, [2, 2], "flat")
    s2 = TDPipeScheduler(cfg, BlockManager(10_000, 4), 2, flat)
    for i in range(8):
        r = Request(i, [1] * 10, 100, predicted_len=100)
        s2._admit_req(r)
        s2.bm.grow(r.rid, 11)
        r.output.append(1)
        r.num_computed = 10
    s2.prefill_mode = False
    s2.add(Request(300, [1] * 2, 10, predicted_len=10))
    s2.update_mode()
    assert not s2.prefill_mode


def test_turnaround_calibrated_from_back_to_back_batches():
    """Stage 1 restarts 5 ms after its previous micro-batch although the input was
    ready: calibration measures that turnaround (tests/test_bench_serve.py: the simulator
    charges it)."""
    from convergent.serve.costs import BatchShape, calibrate_from_run

    log = {}
    for bid in range(20):  # stage 0: 10 ms back to back; stage 1: 10 ms, 5 ms apart
        s0 = (bid * 0.010, bid * 0.010 + 0.010)
        s1 = (0.020 + bid * 0.015, 0.030 + bid * 0.015)
        shape = BatchShape(decode_seqs=4 + bid % 3, decode_ctx=40, sampled=4 + bid % 3)
        log[bid] = {"submit": 0.0, "shape": shape, "stages": {0: s0, 1: s1}, "recv": s1[1]}
    table = calibrate_from_run(log, COSTS)
    assert table.turnaround[0] == pytest.approx(0.0, abs=1e-9)
    assert table.turnaround[1] == pytest.approx(0.005)


def test_tdpipe_queues_deeper_while_prefilling():
    """Prefill micro-batches are independent: 2P in flight while prefilling, P in decode."""
    cfg = SchedulerConfig(kind="tdpipe", max_num_seqs=4, max_batched_tokens=64)
    sched = make_scheduler(cfg, BlockManager(400, 4), 2, COSTS, ignore_eos=True)
    for r in _reqs(40, seed=3, max_in=20):
        sched.add(r)
    assert sched.depth == 4
    first = [sched.schedule() for _ in range(sched.depth)]
    assert all(b is not None and b.kind == "prefill" for b in first)
    _drive(sched, [])  # finish: the driver honours the changing depth
    assert not sched.prefill_mode and sched.depth == 2
    # the prefill-round estimate packs candidates into budget-sized micro-batches
    cands = _reqs(10, seed=4, max_in=30)
    shapes = sched._prefill_shapes(cands)
    assert sum(s.prefill_tokens for s in shapes) == sum(r.total_len for r in cands)
    assert all(s.prefill_tokens <= 64 or s.sampled == 1 for s in shapes)
    assert all(s.sampled <= 4 for s in shapes) and len(shapes) >= 3


FLAT = CostTable([0.0, 1e-3, 0.0, 0.0], [0.0, 0.0], 0.0, 0.0, [2, 2], "flat")


def _two_waves(max_wait_s, dt=0.01, p=2):
    """TD-Pipe on a cost table where batching does not pay (the intensity rule never
    leaves decode for a few small prompts), on a clock that advances ``dt`` per finished
    micro-batch: wave 1 (8 long outputs) decodes, wave 2 (4 short prompts) arrives after
    20 micro-batches. Returns ``(micro-batches from wave 2's arrival to each first token,
    the scheduler)``."""
    t = [0.0]
    cfg = SchedulerConfig(max_num_seqs=64, max_batched_tokens=256, tdpipe_max_wait_s=max_wait_s)
    bm = BlockManager(10_000, 4)
    sched = TDPipeScheduler(cfg, bm, p, FLAT, ignore_eos=True, clock=lambda: t[0])
    wave1 = [Request(i, [1] * 10, 400, predicted_len=400) for i in range(8)]
    wave2 = [Request(100 + i, [2] * 3, 5, predicted_len=5) for i in range(4)]
    for r in wave1:
        sched.add(r)
    inflight, done, arrived, first = [], 0, None, {}
    while sched.has_unfinished() or inflight:
        while len(inflight) < sched.depth and (b := sched.schedule()) is not None:
            inflight.append(b)
        b = inflight.pop(0)
        sched.complete(b, {it.rid: 5 for it in b.items if it.sample})
        done += 1
        t[0] += dt
        if done == 20:
            arrived = done
            for r in wave2:
                sched.add(r)
        for r in wave2:
            if r.output and r.rid not in first:
                first[r.rid] = done - arrived
    return [first[r.rid] for r in wave2], sched


def test_tdpipe_wait_bound_prefills_a_second_wave_in_time():
    """Issue 39: without the bound (an hour: never, here) wave 2 waits for wave 1's 400
    tokens; with ``tdpipe_max_wait_s`` = 1 s it gets its first tokens within 1 s of engine
    time (100 micro-batches) plus a round of P, its prefill and the P batches ahead of it."""
    p, dt = 2, 0.01
    off, s_off = _two_waves(3600.0, dt, p)
    assert min(off) > 300 and s_off.aged_switches == 0  # the intensity rule alone: starved
    on, s_on = _two_waves(1.0, dt, p)
    bound = round(1.0 / dt) + 3 * p
    assert max(on) <= bound and s_on.aged_switches >= 1
    assert min(on) >= round(1.0 / dt) - 1  # and not earlier: the rule did not switch itself
