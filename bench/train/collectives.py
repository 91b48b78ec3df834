"""Topology-aware gradient communication on an emulated 2 nodes x 2 ranks network.

scripts/netemu.sh builds two network namespaces ("nodes") joined by one veth pair
shaped with tc tbf (the "inter-node" link); 4 gloo ranks run bench/train/collectives_worker.py
(2 per node, each node's ranks pinned to one CPU). At each shaped bandwidth, in interleaved rounds (the variant order
rotates per round), it measures per training step the bytes leaving node A on the
link (interface counters) and the step time for: flat ring DDP (ranks node-contiguous),
flat with a scattered placement (ranks 0,2 on node A), hierarchical DDP, hierarchical
with top-k (3%, error feedback) on the inter-node hop, FSDP over all 4 ranks and HSDP
(shard in node, replicate across). Communication time, per step: the slowest rank's
step minus the slowest rank's step of the same model without communication, run just
before it (paired: the same moment and load), the median over the timed steps.

Each measured byte count stands next to its theoretical value (bench.train.commcost,
derivations in its docstring). The α-β model is fitted per bandwidth from a calibration
run in each launch before the variants, never from the step times it predicts: (a) one
pair at a time, 2-rank all-reduces of 64 KiB-4 MiB across the link and inside a node (the
raw link figures, plain least squares; ``link_only_model_*`` is the model on these
alone); (b) each collective the variants are made of (all-reduce, reduce-scatter,
all-gather over all ranks, inside the nodes, across the nodes), issued asynchronously and
waited for as DDP hooks and FSDP2 do, run by every group of its level at once, as in the
step: four gloo ranks share two cores and two cross-node pairs share the veth, so a
collective's cost depends on what runs beside it; (c) the hierarchical hook's passes over
the bucket and the top-k selection; (d) per level, the synchronisation cost of a
collective that waits for every rank's compute (a 4-byte all-reduce after backward,
paired against the same step without it): on an oversubscribed CPU ranks stop
overlapping their compute there. Per phase, α and β per ring step come per size regime
(between adjacent calibration sizes: a token bucket passes small messages at line rate
and large ones at the shaped rate; median timing over rounds); the model composes them
by ring step counts per variant, adds DDP's bucket copies and the synchronisation points
(DDP: one after backward, top-k: one more before its inter-node all-gather; FSDP / HSDP:
two per unit), and takes off the bytes tbf's 256 KiB bucket, refilled at the shaped rate
while the slow link idled, lets through at line rate; it predicts every variant's
communication time (relative error reported) and is projected to 64-4096 GPUs with
NVLink / InfiniBand figures (there the link-level terms are the stated datasheet
assumptions).

The variants of one round run inside one launch (their order rotates per round), so the
rounds are driven here rather than by bench/lib/harness.py's ``interleave``; the harness
gives the provenance (commit, versions, machine, load before/after), the dirty-tree
refusal and the median/min/max/IQR of every measured number.

Usage (root): ``python -m bench.train.collectives [--rounds 3] [--allow-dirty]``; writes
bench/results/collectives.json and collectives.png beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.harness import (
    add_args,
    check_clean,
    provenance,
    spread,
    stamp,
    stamp_png,
    write_result,
)
from bench.lib.paths import RESULTS, child_env, module_argv
from bench.train import commcost as cc
from bench.train.collectives_projection import IB, NVLINK, PUBLISHED, project
from bench.train.netemu import EmulatedNetwork, unavailable, wait_all

VARIANTS = ["flat", "hier", "hier_topk", "fsdp", "hsdp"]
CALIB = [65536, 262144, 1048576, 4194304]
# each emulated node's ranks pinned to a CPU of their own (taskset), as real nodes have:
# unpinned, four ranks migrate over two cores and the same variant's communication time
# spread by up to 42% between rounds (unshaped; 26% at 1 Gbit/s), pinned by up to 20%
_cpus = sorted(os.sched_getaffinity(0))
NODE_CPUS = [_cpus[0], _cpus[1 % len(_cpus)]]
# link figures by plain least squares (the variants move 0.25-4 MiB per collective); the
# phases α-β per size regime (commcost.Regimes: through adjacent calibration sizes)
FIT = "absolute"
PHASE_FIT = "regimes"
TBF_BURST = 256 * 1024  # scripts/netemu.sh: tbf ... burst 256kb (tc's kb: 1024 bytes)
# the collectives the variants are made of, each calibrated on every group of its level at
# once (commcost's measured phases); the scattered launch calibrates its own world ring
PHASES = ["world_ar", "world_ag", "world_rs", "intra_rs", "intra_ag", "cross_ar", "cross_ag"]
# top-k keeps 3% of each inter-node shard: at 1% the eval loss stayed ~7% above flat after
# 30 and after 100 steps (error feedback delays too much mass); 3% sends 0.04x flat's bytes
# (2 * 0.03 / 1.5); the loss gap shrinks as error feedback catches up (loss_check records it
# at 30, 100 and 200 steps).
RATIO = 0.03


def launch(net: EmulatedNetwork, placement: list[int], variants: list[str], out: Path,
           steps: int, warmup: int, calib: list[str] | None, port: int,
           eval_at: str = "") -> dict:
    argv = [*module_argv("bench.train.collectives_worker"), "--variants",
            ",".join(variants), "--steps", str(steps), "--warmup", str(warmup),
            "--topk-ratio", str(RATIO), "--out", str(out)]
    if calib is not None:
        argv += ["--calib", ",".join(map(str, CALIB)), "--calib-phases", ",".join(calib)]
    if eval_at:
        argv += ["--eval-at", eval_at]
    procs = net.spawn(argv, placement, port=port, env=child_env(), log_dir=out.parent,
                      node_cpus=NODE_CPUS)
    codes = wait_all(procs, timeout=600)
    if codes != [0] * len(procs):
        logs = (out.parent / "rank0.log").read_text()[-3000:]
        raise RuntimeError(f"worker failed {codes}: {logs}")
    return json.loads(out.read_text())


def summarise(res: dict, warmup: int) -> dict:
    """Per variant: median bytes out of node A / B per step, median step time."""
    out = {}
    for v, ranks in res["variants"].items():
        steps = list(zip(*[r["steps"] for r in ranks], strict=True))[warmup:]
        a = [r for r in ranks if r["node"] == 0 and r["local_rank"] == 0][0]["steps"][warmup:]
        b = [r for r in ranks if r["node"] == 1 and r["local_rank"] == 0][0]["steps"][warmup:]
        out[v] = {"out_a": statistics.median(s["tx"] for s in a),
                  "out_b": statistics.median(s["tx"] for s in b),
                  "step_s": statistics.median(max(r["s"] for r in st) for st in steps),
                  # per step: the slowest rank's step minus the slowest rank's paired
                  # no-communication step just before it
                  "paired_comm_s": statistics.median(
                      max(r["s"] for r in st) - max(r["ref_s"] for r in st) for st in steps)
                  if steps and steps[0][0].get("ref_s") is not None else None,
                  "eval_loss": ranks[0]["eval_loss"],
                  "last_loss": statistics.fmean(r["steps"][-1]["loss"] for r in ranks)}
    return out


def median_timings(calibs: list[dict], key: str) -> tuple[list[float], list[float]]:
    """Sizes and, per size, the median over rounds of the calibration timings of ``key``."""
    sizes = list(calibs[0][key])
    return ([float(x) for x in sizes],
            [statistics.median(c[key][x] for c in calibs) for x in sizes])


def calibrated_nets(rounds: list[dict], nodes: int = 2, per_node: int = 2) -> dict[str, cc.Net]:
    """The α-β networks of one rate, fitted on the median calibration timings over rounds:
    ``link`` from the one-pair-at-a-time all-reduces only (2 steps of S/2: the raw link
    figures), ``phases`` with every measured phase and the hook's copy cost added, and
    ``phases_scattered`` with the world ring measured under the scattered placement."""
    cal = [r["calibration"] for r in rounds]
    slow = cc.fit_link(*median_timings(cal, "slow"), steps=2, per_step=0.5, weight=FIT)
    fast = cc.fit_link(*median_timings(cal, "fast"), steps=2, per_step=0.5, weight=FIT)
    link = cc.Net(nodes, per_node, fast, slow)
    measured = {}
    for phase in PHASES:
        level = phase.split("_")[0]
        measured[phase] = cc.fit_phase(phase, link.group(level), *median_timings(cal, phase),
                                       weight=PHASE_FIT)
    copy = cc.fit_link(*median_timings(cal, "copy"), steps=1, per_step=1.0)
    sync = ({lv: statistics.median(c["sync_s"][lv] for c in cal) for lv in cal[0]["sync_s"]}
            if "sync_s" in cal[0] else {})
    phases = dataclasses.replace(link, measured=measured, copy_beta=copy.beta / cc.HOOK_PASSES,
                                 sync=sync)
    scat = [r["calibration_scattered"] for r in rounds]
    ring = cc.fit_phase("world_ar", link.world, *median_timings(scat, "world_ar"),
                        weight=PHASE_FIT)
    return {"link": link, "phases": phases,
            "phases_scattered": dataclasses.replace(phases, measured={**measured,
                                                                      "world_ar": ring})}


def theory(net: cc.Net, units: list[float], topk_s: float = 0.0,
           scattered: cc.Net | None = None, compute_s: float = 0.0, burst: float = 0.0,
           wire_beta: float = 0.0) -> dict[str, cc.Cost]:
    """Bytes and α-β(-γ) time per variant; ``topk_s``: the calibrated top-k compute;
    ``scattered``: the network as calibrated under the scattered placement;
    ``compute_s``: the no-communication step; ``burst``: the token bucket's size (0:
    unshaped); ``wire_beta``: the shaped link's s/byte.

    tbf refills its bucket at the shaped rate while the slow link idles, up to ``burst``:
    in a DDP step from the end of one step's slow hop to the next one's (the compute,
    then the hook's work before its inter-node phase); HSDP's first cross-node
    all-reduce after the forward pass and the first unit's backward. That credit leaves
    at line rate (:func:`bench.train.commcost.burst_saving`)."""
    size = sum(units)
    rs = [True] * len(units)
    ddp = cc.local_passes(net, size, cc.DDP_PASSES)  # bucket copies (local has none)
    flat_ddp = cc.local_passes(net, size, cc.DDP_PASSES + 1)  # + allreduce_hook's div_
    L, n = net.per_node, net.nodes
    k = math.ceil(RATIO * size / 4 / L)
    before_hop = cc.collective(net, "intra", "rs", size) + cc.HOOK_PASSES * size * net.copy_beta
    backward = 2 / 3 * compute_s  # backward ~ twice the forward's matmuls
    idle = {"flat": compute_s, "flat_scattered": compute_s, "hier": compute_s + before_hop,
            "hier_topk": compute_s + before_hop + topk_s,
            "hsdp": compute_s - backward + backward / len(units)
            + sum(cc.collective(net, "intra", "ag", u) for u in units)
            + cc.collective(net, "intra", "ag", units[-1]) + cc.collective(net, "intra", "rs", units[-1])}
    first = {"flat": size / net.world, "flat_scattered": L * size / net.world,
             "hier": L * size / L / n, "hier_topk": L * 8 * k,
             "hsdp": 2 * (n - 1) * units[-1] / n}  # egress bytes of the first slow step
    saving = {v: cc.burst_saving(net, b, min(burst, idle[v] / wire_beta) if wire_beta else 0.0)
              for v, b in first.items()}
    # synchronisation points after compute: DDP's one bucket after backward (the
    # hierarchical hook's later collectives follow one another, except top-k's inter-node
    # all-gather, which waits for every rank's top-k selection); FSDP / HSDP per unit the
    # forward all-gather and the gradient reduce-scatter (backward all-gathers are
    # prefetched one unit ahead)
    ddp_sync = {lv: cc.sync_points(net, lv, 1) for lv in ("world", "intra")}
    fsdp_sync = {lv: cc.sync_points(net, lv, 2 * len(units)) for lv in ("world", "intra")}
    return {
        "flat": cc.flat_ring(net, size) + flat_ddp + saving["flat"] + ddp_sync["world"],
        "flat_scattered": cc.flat_ring(scattered or net, size, scattered=True) + flat_ddp
        + saving["flat_scattered"] + ddp_sync["world"],
        "hier": cc.hierarchical(net, size) + ddp + saving["hier"] + ddp_sync["intra"],
        "hier_topk": cc.hierarchical_topk(net, size, RATIO) + cc.Cost(topk_s, 0.0) + ddp
        + saving["hier_topk"] + ddp_sync["intra"] + cc.sync_points(net, "cross", 1),
        "fsdp": cc.fsdp(net, units, rs, rs_allreduce=True) + fsdp_sync["world"],  # gloo
        "fsdp_ring_rs": cc.fsdp(net, units, rs),  # NCCL-style ring reduce-scatter
        "hsdp": cc.hsdp(net, units, rs) + saving["hsdp"]
        + fsdp_sync["intra"],
    }


def reference(summary: dict, suffix: str = "") -> float:
    """The launch's compute-only step time: the mean of ``local`` at its start and
    ``local_end`` at its end (older raw results have only the first)."""
    ends = [summary[k]["step_s"] for k in (f"local{suffix}", f"local_end{suffix}") if k in summary]
    return statistics.fmean(ends)


def comm_time(summary: dict, variant: str, suffix: str = "") -> float:
    """A round's communication time of ``variant``: the median over steps of its step
    minus the paired no-communication step (older raw results: the step minus the
    launch's compute reference)."""
    paired = summary[variant].get("paired_comm_s")
    return paired if paired is not None else summary[variant]["step_s"] - reference(summary, suffix)


def link_fit(link: cc.Link) -> dict:
    return {"alpha_s": link.alpha, "beta_s_per_byte": link.beta,
            "bandwidth_Mbit_s": 8e-6 / link.beta if link.beta else None}


def measure(args: argparse.Namespace, rates: list[str]) -> tuple[dict, dict]:
    """Every round at every rate on the emulated network, then the loss check; the raw
    results are also kept as raw.json in a temporary folder (``--reanalyse`` reads it)."""
    tmp = Path(tempfile.mkdtemp(prefix="bench_coll_"))
    raw: dict[str, list[dict]] = {r: [] for r in rates}
    name = f"cvb{os.getpid() % 100000}"
    port = 29700 + os.getpid() % 200
    with EmulatedNetwork(name, rates[0]) as net:
        for rnd in range(args.rounds):
            for rate in rates[rnd % len(rates):] + rates[: rnd % len(rates)]:
                net.shape(rate)
                k = rnd % len(VARIANTS)
                # the compute reference at both ends of the launch (load drifts)
                order = ["local", *VARIANTS[k:], *VARIANTS[:k], "local_end"]
                print(f"round {rnd} rate {rate}: {order}", flush=True)
                d = tmp / f"{rnd}_{rate}"
                d.mkdir()
                res = launch(net, [0, 0, 1, 1], order, d / "c.json", args.steps,
                             args.warmup, PHASES, port)
                port += 1
                ds = tmp / f"{rnd}_{rate}_s"
                ds.mkdir()
                sc = launch(net, [0, 1, 0, 1], ["local", "flat", "local_end"], ds / "s.json",
                            args.steps, args.warmup, ["world_ar"], port)
                port += 1
                summ = summarise(res, args.warmup)
                ssum = summarise(sc, args.warmup)
                summ["flat_scattered"] = ssum["flat"]
                summ["local_scattered"] = ssum["local"]
                summ["local_end_scattered"] = ssum["local_end"]
                raw[rate].append({"summary": summ, "calibration": res["calibration"],
                                  "calibration_scattered": sc["calibration"],
                                  "units_bytes": res["units_bytes"]})
        net.shape("none")
        d = tmp / "loss"
        d.mkdir()
        checkpoints = sorted({n for n in (30, 100, args.loss_steps) if n <= args.loss_steps})
        conv = launch(net, [0, 0, 1, 1], ["flat", "hier_topk"], d / "l.json",
                      args.loss_steps, 0, None, port, ",".join(map(str, checkpoints)))
    (tmp / "raw.json").write_text(json.dumps({"raw": raw, "conv": conv}))
    print(f"raw results: {tmp / 'raw.json'}", flush=True)
    return raw, conv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="100mbit,1gbit,none")
    # the hierarchical variants settle over their first ~4 steps (new process groups'
    # first transfers): 4 warm-up steps, the median of the next 8
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--loss-steps", type=int, default=200)
    ap.add_argument("--reanalyse", default="",
                    help="raw.json of an earlier run: fit and report again, measure nothing")
    add_args(ap, str(RESULTS / "collectives.json"), rounds=3)
    args = ap.parse_args()
    why = unavailable()
    if why:
        sys.exit(f"bench/train/collectives.py: {why}")
    check_clean(args)

    t_start = time.time()
    prov = provenance()
    rates = args.rates.split(",")
    if args.reanalyse:
        saved = json.loads(Path(args.reanalyse).read_text())
        raw, conv = saved["raw"], saved["conv"]
    else:
        raw, conv = measure(args, rates)
    units = raw[rates[0]][0]["units_bytes"]
    results: dict = {}
    errors = []
    for rate in rates:
        rounds = raw[rate]
        entry: dict = {"variants": {}}
        nets = calibrated_nets(rounds)
        topk_s = statistics.median(r["calibration"]["topk_compute_s"] for r in rounds)
        fl = [float(u) for u in units]
        # tbf's credit: see theory(); unshaped: no bucket. The calibration's repetitions
        # are a barrier apart: at 100 Mbit/s that refills a few tens of KB (the step's
        # credit dominates), at 1 Gbit/s up to the whole bucket, so there the credit
        # counts up to ~2 ms twice (left in, stated).
        compute = statistics.median(reference(r["summary"]) for r in rounds)
        shaped = rate != "none"
        wire = nets["link"].slow.beta
        th = theory(nets["phases"], fl, topk_s, nets["phases_scattered"], compute,
                    TBF_BURST if shaped else 0.0, wire)
        th_link = theory(nets["link"], fl, topk_s)
        entry["fit"] = {"slow": link_fit(nets["link"].slow), "fast": link_fit(nets["link"].fast),
                        "phases": {k: link_fit(v) for k, v in nets["phases"].measured.items()},
                        "world_ar_scattered": link_fit(
                            nets["phases_scattered"].measured["world_ar"]),
                        "copy_s_per_byte": nets["phases"].copy_beta,
                        "topk_compute_s": topk_s, "compute_s": compute,
                        "tbf_burst_bytes": TBF_BURST if shaped else 0,
                        "sync_s_per_point": nets["phases"].sync}
        for v in ["flat", "flat_scattered", "hier", "hier_topk", "fsdp", "hsdp"]:
            sfx = "_scattered" if v == "flat_scattered" else ""
            out_a = [r["summary"][v]["out_a"] for r in rounds]
            step = [r["summary"][v]["step_s"] for r in rounds]
            comm = [comm_time(r["summary"], v, sfx) for r in rounds]
            pred = th[v].seconds
            mc = statistics.median(comm)
            err = abs(pred - mc) / mc if mc > 0 else None
            entry["variants"][v] = {
                "node_out_bytes_per_step": spread(out_a),
                "node_out_bytes_theory": th[v].node_out_bytes,
                "bytes_vs_theory": statistics.median(out_a) / th[v].node_out_bytes,
                "step_s": spread(step), "comm_s": spread(comm), "model_comm_s": pred,
                "model_rel_error": err,
                # the same model on the one-pair link figures alone (no phase calibration)
                "link_only_model_comm_s": th_link[v].seconds,
                "link_only_model_rel_error": abs(th_link[v].seconds - mc) / mc if mc > 0 else None,
                "eval_loss": statistics.median(r["summary"][v]["eval_loss"] for r in rounds),
            }
            errors.append((rate, v, err))
        entry["fsdp_ring_rs_theory_bytes"] = th["fsdp_ring_rs"].node_out_bytes
        results[rate] = entry
    ref_rate = rates[0]
    V = results[ref_rate]["variants"]

    def ratio(a: str, b: str) -> float:
        return V[a]["node_out_bytes_per_step"]["median"] / V[b]["node_out_bytes_per_step"]["median"]

    conv_s = summarise(conv, 0)
    valid = [e for _, _, e in errors if e is not None]
    data = {
        "description": __doc__.split("\n\n")[1].replace("\n", " "),
        "cost_model": __doc__.split("\n\n")[2].replace("\n", " "),
        "inter_bytes_ratio_hier_vs_flat": ratio("hier", "flat"),
        "inter_bytes_ratio_hsdp_vs_fsdp": ratio("hsdp", "fsdp"),
        "inter_bytes_ratio_topk_vs_flat": ratio("hier_topk", "flat"),
        "inter_bytes_ratio_scattered_vs_flat": ratio("flat_scattered", "flat"),
        "step_time_ratio_hier_vs_flat": V["hier"]["step_s"]["median"] / V["flat"]["step_s"]["median"],
        "model_max_rel_error": max(valid) if valid else None,
        "model_rel_errors": [{"rate": r, "variant": v, "rel_error": e} for r, v, e in errors],
        "ratio_reference_rate": ref_rate,
        "ratios_of": "medians over rounds of the bytes leaving node A per step",
        "theory_ratios": {"hier_vs_flat": 2 / 3, "hsdp_vs_fsdp_gloo": 1 / 3,
                          "hsdp_vs_fsdp_ring_reduce_scatter": 4 / 9,
                          "topk_vs_flat": 2 * RATIO / 1.5, "scattered_vs_flat": 2.0},
        "loss_check": {
            "steps": args.loss_steps, "rate": "none",
            "flat_eval_loss": conv_s["flat"]["eval_loss"],
            "hier_topk_eval_loss": conv_s["hier_topk"]["eval_loss"],
            "rel_diff": conv_s["hier_topk"]["eval_loss"] / conv_s["flat"]["eval_loss"] - 1,
            # the gap along the way (same run): error feedback delivers the dropped mass late
            "rel_diff_at_step": {
                n: conv["variants"]["hier_topk"][0]["evals"][n] / conv["variants"]["flat"][0]["evals"][n] - 1
                for n in conv["variants"]["flat"][0]["evals"]},
        },
        "results": results,
        "projection": {"grad_bytes": 2e9, "rows": project(
            [64, 128, 256, 512, 1024, 2048, 4096], 2e9),
            "nvlink": NVLINK, "infiniband": IB, "published": PUBLISHED},
        "rounds": args.rounds,
        "settings": {"rates": rates, "rounds": args.rounds, "steps": args.steps,
                     "warmup": args.warmup, "topk_ratio": RATIO, "units_bytes": units,
                     "nodes": 2, "ranks_per_node": 2, "backend": "gloo",
                     "threads_per_rank": 1, "model": "MLP, dim 512, 4 layers, batch 32 per rank",
                     "ddp": {"bucket_cap_mb": 1000, "broadcast_buffers": False},
                     "fsdp": {"reshard_after_forward": True},
                     "calibration_bytes": CALIB},
        "seconds": time.time() - t_start,
    }
    out = stamp("collectives", prov, data, differences=[
        "every variant trains the same model, data, seed and steps on the same 4 ranks "
        "(1 thread each) and shaped link; they differ only in how gradients travel",
        "the DDP variants (flat, hier, hier_topk) share the DDP options (one 1000 MB bucket, "
        "broadcast_buffers=False); FSDP and HSDP shard each block and the root "
        "(reshard_after_forward=True)",
        "flat_scattered (ranks 0,2 on node A) runs in a second launch of the same round, "
        "with its own local reference step",
        "hier_topk sends 3% of the gradient entries (error feedback) on the inter-node hop: "
        "its eval loss after loss_check.steps is compared with flat's"])
    dest = Path(args.out)
    write_result(out, args)
    plot(out, dest.with_suffix(".png"))
    stamp_png(dest.with_suffix(".png"), out.get("commit"), "collectives")
    print(json.dumps({k: out[k] for k in list(out)[3:12]}, indent=1))


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    rate = out["ratio_reference_rate"]
    V = out["results"][rate]["variants"]
    names = list(V)
    x = range(len(names))
    axes[0].bar([i - 0.2 for i in x], [V[n]["node_out_bytes_per_step"]["median"] / 1e6
                                       for n in names], 0.4, label="measured")
    axes[0].bar([i + 0.2 for i in x], [V[n]["node_out_bytes_theory"] / 1e6 for n in names],
                0.4, label="theory")
    axes[0].set_xticks(list(x), names, rotation=30)
    axes[0].set_ylabel("MB leaving a node per step")
    axes[0].set_title(f"inter-node bytes at {rate}")
    axes[0].legend()
    pts = []
    for r, res in out["results"].items():
        vs = {n: v for n, v in res["variants"].items() if v["comm_s"]["median"] > 0}
        axes[1].scatter([vs[n]["comm_s"]["median"] for n in vs],
                        [vs[n]["model_comm_s"] for n in vs], label=r)
        pts += [vs[n]["comm_s"]["median"] for n in vs]
    if pts:  # log-log: the unshaped (ms) and 100 Mbit/s (s) points on one plot
        lo, hi = min(pts) / 1.5, max(pts) * 1.5
        axes[1].plot([lo, hi], [lo, hi], "k--", lw=0.8)
        for f in (0.85, 1.15):
            axes[1].plot([lo, hi], [lo * f, hi * f], "k:", lw=0.6)
        axes[1].set_xscale("log")
        axes[1].set_yscale("log")
    axes[1].set_xlabel("measured comm s/step")
    axes[1].set_ylabel("α-β model s/step (dotted: ±15%)")
    axes[1].set_title("cost model vs measurement")
    axes[1].legend()
    rows = [r for r in out["projection"]["rows"] if "flat_ring_s" in r]
    g = [r["gpus"] for r in rows]
    for key in ("flat_ring_s", "tree_s", "hierarchical_s", "hierarchical_topk1pct_s",
                "hierarchical_shared_fabric_x2_s", "hierarchical_overlap50_exposed_s"):
        axes[2].plot(g, [r[key] for r in rows], marker="o", label=key[:-2])
    axes[2].set_xscale("log", base=2)
    axes[2].set_yscale("log")
    axes[2].set_xlabel("GPUs (8 per node, NVLink + IB NDR)")
    axes[2].set_ylabel("all-reduce s (2 GB gradients)")
    axes[2].set_title("α-β projection")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
