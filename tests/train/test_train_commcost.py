"""α-β cost model (convergent.train.commcost): byte counts and time terms."""

from __future__ import annotations

import pytest

from convergent.config import load_config
from convergent.errors import ConfigError
from convergent.train import commcost as cc

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
