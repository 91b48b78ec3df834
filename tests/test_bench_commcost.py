"""α-β cost model of bench/train/collectives.py (bench/train/commcost.py): byte counts and
time terms."""

from __future__ import annotations

import pytest

from bench.train import commcost as cc
from convergent.config import load_config
from convergent.core.errors import ConfigError

FAST = cc.Link(1e-6, 1e-10)
SLOW = cc.Link(1e-4, 1e-8)


def test_bytes_leaving_a_node_2x2() -> None:
    net = cc.Net(2, 2, FAST, SLOW)
    s = 4e6
    flat = cc.flat_ring(net, s)
    assert flat.node_out_bytes == pytest.approx(1.5 * s)  # 2(P-1)/P S, one crossing edge
    assert cc.flat_ring(net, s, scattered=True).node_out_bytes == pytest.approx(3 * s)
    hier = cc.hierarchical(net, s)
    assert hier.node_out_bytes / flat.node_out_bytes == pytest.approx(2 / 3)
    topk = cc.hierarchical_topk(net, s, 0.01)
    assert topk.node_out_bytes == pytest.approx(8 * 0.01 * s / 4, rel=1e-3)
    units, rs = [s / 4] * 4, [True] * 4
    assert cc.hsdp(net, units, rs).node_out_bytes / cc.fsdp(net, units, rs).node_out_bytes \
        == pytest.approx(4 / 9)
    gloo = cc.fsdp(net, units, rs, rs_allreduce=True)
    assert cc.hsdp(net, units, rs).node_out_bytes / gloo.node_out_bytes == pytest.approx(1 / 3)


def test_time_terms() -> None:
    net = cc.Net(2, 2, FAST, SLOW)
    s = 4e6
    # flat ring: 6 slow steps of S/4
    assert cc.flat_ring(net, s).seconds == pytest.approx(6 * (1e-4 + s / 4 * 1e-8))
    # hierarchical: 2 fast steps of S/2 + 2 slow steps carrying S/2 through the egress
    want = 2 * (1e-6 + s / 2 * 1e-10) + 2 * (1e-4 + s / 2 * 1e-8)
    assert cc.hierarchical(net, s).seconds == pytest.approx(want)
    # one NIC per rank: the concurrent cross-node flows do not share the egress
    nic = cc.Net(2, 2, FAST, SLOW, shared_egress=False)
    assert cc.hierarchical(nic, s).seconds < cc.hierarchical(net, s).seconds
    busy = cc.Net(2, 2, FAST, SLOW, contention=2.0)
    assert cc.hierarchical(busy, s).seconds > cc.hierarchical(net, s).seconds
    assert cc.exposed(cc.Cost(1.0, 0), backward_s=0.3, overlap=0.5) == pytest.approx(0.7)


def test_fit_link_recovers_alpha_beta() -> None:
    sizes = [1e4, 1e5, 1e6, 4e6]
    secs = [2 * (3e-4 + 0.5 * x * 2e-8) for x in sizes]  # 2-rank all-reduce
    link = cc.fit_link(sizes, secs, steps=2, per_step=0.5)
    assert link.alpha == pytest.approx(3e-4, rel=1e-6)
    assert link.beta == pytest.approx(2e-8, rel=1e-6)


def test_allreduce_setting_is_validated() -> None:
    assert load_config(None, []).parallel.allreduce == "auto"
    assert load_config(None, ["parallel.allreduce=hierarchical"]).parallel.allreduce \
        == "hierarchical"
    with pytest.raises(ConfigError, match="parallel.allreduce"):
        load_config(None, ["parallel.allreduce=butterfly"])


def test_fit_phase_recovers_per_step_alpha_beta() -> None:
    """Synthetic calibration timings of a phase (ring steps x (alpha + chunk * beta)) give
    back its per-step alpha and beta: all-reduce over 4 ranks (6 steps of S/4),
    reduce-scatter over 2 (1 step of S/2), all-gather over 2."""
    sizes = [65536.0, 262144.0, 1048576.0, 4194304.0]
    for phase, group, steps in (("world_ar", 4, 6), ("intra_rs", 2, 1), ("cross_ag", 2, 1)):
        secs = [steps * (2e-3 + s / group * 7e-9) for s in sizes]
        link = cc.fit_phase(phase, group, sizes, secs)
        assert link.alpha == pytest.approx(2e-3, rel=1e-6), phase
        assert link.beta == pytest.approx(7e-9, rel=1e-6), phase
    # noisy timings: least squares lands near the truth, not on one point
    noisy = [6 * (1e-3 + s / 4 * 5e-9) * f for s, f in zip(sizes, [1.1, 0.9, 1.05, 0.97],
                                                            strict=True)]
    link = cc.fit_phase("world_ar", 4, sizes, noisy)
    assert link.beta == pytest.approx(5e-9, rel=0.1)
    with pytest.raises(ValueError, match="collective"):
        cc.fit_phase("world_bcast", 4, sizes, noisy)


def test_measured_phases_replace_link_terms() -> None:
    """A calibrated phase prices its collective (flows and sharing are in the
    measurement); phases not measured fall back to the link-level alpha-beta terms."""
    s = 4e6
    rs, ag, car = cc.Link(3e-3, 4e-9), cc.Link(2e-3, 3e-9), cc.Link(1e-3, 2e-8)
    net = cc.Net(2, 2, FAST, SLOW, measured={"intra_rs": rs, "intra_ag": ag, "cross_ar": car},
                 copy_beta=1e-10)
    want = rs.t(s / 2) + ag.t(s / 2) + 2 * car.t(s / 2 / 2) + cc.HOOK_PASSES * s * 1e-10
    hier = cc.hierarchical(net, s)
    assert hier.seconds == pytest.approx(want)
    # bytes on the links do not depend on how the time was calibrated
    assert hier.node_out_bytes == cc.hierarchical(cc.Net(2, 2, FAST, SLOW), s).node_out_bytes
    # flat ring not measured here: the slow link's terms as before
    assert cc.flat_ring(net, s).seconds == pytest.approx(6 * (1e-4 + s / 4 * 1e-8))
    ring = cc.Link(5e-4, 6e-9)
    meas = cc.Net(2, 2, FAST, SLOW, measured={"world_ar": ring})
    assert cc.flat_ring(meas, s, scattered=True).seconds == pytest.approx(6 * ring.t(s / 4))
    # HSDP per unit: 2 all-gathers + 1 reduce-scatter in the node, all-reduce of s/2 across
    u = 1e6
    want_u = 2 * ag.t(u / 2) + rs.t(u / 2) + 2 * car.t(u / 2 / 2)
    assert cc.hsdp(net, [u], [True]).seconds == pytest.approx(want_u)


def test_fit_link_weighs_relative_error() -> None:
    """One timing 30% high at the largest size barely moves the relative-error fit at the
    small sizes, where α dominates (an unweighted fit is pulled by the big absolute
    residual: its α halves here)."""
    sizes = [65536.0, 262144.0, 1048576.0, 4194304.0]
    secs = [2 * (1e-3 + 0.5 * x * 8e-9) for x in sizes]
    secs[-1] *= 1.3
    link = cc.fit_link(sizes, secs, steps=2, per_step=0.5)
    for x in sizes[:2]:
        assert 2 * link.t(0.5 * x) == pytest.approx(2 * (1e-3 + 0.5 * x * 8e-9), rel=0.05)
    assert link.alpha == pytest.approx(1e-3, rel=0.15)
    assert cc.fit_link(sizes, [0.0] * 4, steps=2, per_step=0.5) == cc.Link(0.0, 0.0)


def test_local_passes_price_copies_without_bytes() -> None:
    net = cc.Net(2, 2, FAST, SLOW, copy_beta=2e-11)
    c = cc.local_passes(net, 4e6, cc.DDP_PASSES)
    assert c.seconds == pytest.approx(cc.DDP_PASSES * 4e6 * 2e-11)
    assert c.node_out_bytes == 0.0
    # the hierarchical hook's passes are inside hierarchical(); none without a copy cost
    bare = cc.Net(2, 2, FAST, SLOW)
    assert cc.hierarchical(net, 4e6).seconds - cc.hierarchical(bare, 4e6).seconds \
        == pytest.approx(cc.HOOK_PASSES * 4e6 * 2e-11)


def test_burst_saving_is_capped_by_bucket_and_payload() -> None:
    net = cc.Net(2, 2, FAST, SLOW)  # slow beta 1e-8 s/byte
    assert cc.burst_saving(net, 1e6, 256e3).seconds == pytest.approx(-256e3 * 1e-8)
    assert cc.burst_saving(net, 100e3, 256e3).seconds == pytest.approx(-100e3 * 1e-8)
    assert cc.burst_saving(net, 1e6, 0.0).seconds == 0.0
    assert cc.burst_saving(net, 1e6, 256e3).node_out_bytes == 0.0


def test_fit_link_absolute_weight_follows_the_large_sizes() -> None:
    """Plain least squares: a 30% outlier at the smallest size (scheduling noise) barely
    moves β, which prices megabyte messages; the relative fit lets it tilt β."""
    sizes = [65536.0, 262144.0, 1048576.0, 4194304.0]
    secs = [2 * (1e-3 + 0.5 * x * 8e-9) for x in sizes]
    secs[0] *= 1.3
    ab = cc.fit_link(sizes, secs, steps=2, per_step=0.5, weight="absolute")
    rel = cc.fit_link(sizes, secs, steps=2, per_step=0.5)
    assert ab.beta == pytest.approx(8e-9, rel=0.02)
    assert abs(rel.beta - 8e-9) > abs(ab.beta - 8e-9)
    with pytest.raises(ValueError, match="weight"):
        cc.fit_link(sizes, secs, steps=2, per_step=0.5, weight="huber")


def test_regimes_price_each_size_range_by_its_own_alpha_beta() -> None:
    """A token bucket: messages up to 256 KiB at line rate (fast β), larger ones at the
    shaped rate. One α-β line misprices both ends; the regime fit reproduces every
    calibration point and interpolates linearly between them."""
    sizes = [65536.0, 262144.0, 1048576.0, 4194304.0]

    def truth(s: float) -> float:  # per ring step of s/4 bytes, 6 steps (4-rank all-reduce)
        chunk = s / 4
        return 6 * (5e-4 + min(chunk, 65536) * 1e-9 + max(chunk - 65536, 0) * 8e-9)

    secs = [truth(s) for s in sizes]
    reg = cc.fit_phase("world_ar", 4, sizes, secs, weight="regimes")
    assert isinstance(reg, cc.Regimes) and len(reg.links) == 3
    for s, t in zip(sizes, secs, strict=True):
        assert 6 * reg.t(s / 4) == pytest.approx(t, rel=1e-9)
    mid = 2 * 1048576.0  # inside the last regime: on the line through its two sizes
    assert 6 * reg.t(mid / 4) == pytest.approx(truth(mid), rel=1e-9)
    line = cc.fit_phase("world_ar", 4, sizes, secs)
    worst_line = max(abs(6 * line.t(s / 4) / t - 1) for s, t in zip(sizes, secs, strict=True))
    assert worst_line > 0.1  # why regimes: one line is off somewhere by more than 10%
    assert reg.beta == reg.links[-1].beta  # the bandwidth regime is what gets reported
    # a measured phase may be regimes: collective() prices it like a Link
    net = cc.Net(2, 2, FAST, SLOW, measured={"world_ar": reg})
    assert cc.flat_ring(net, mid).seconds == pytest.approx(truth(mid), rel=1e-9)
    with pytest.raises(ValueError, match="two sizes"):
        cc.fit_regimes([1.0], [1.0], steps=1, per_step=1.0)


def test_sync_points_cost_per_level_and_count() -> None:
    """Synchronisation points after compute add the measured per-level cost times their
    count, move no bytes, and cost nothing where none was measured."""
    net = cc.Net(2, 2, FAST, SLOW, sync={"world": 4e-3, "intra": 1e-3})
    assert cc.sync_points(net, "world", 3) == cc.Cost(pytest.approx(12e-3), 0.0)
    assert cc.sync_points(net, "intra", 8).seconds == pytest.approx(8e-3)
    assert cc.sync_points(net, "cross", 2).seconds == 0.0
    assert cc.sync_points(cc.Net(2, 2, FAST, SLOW), "world", 5).seconds == 0.0
