"""The α-β model of bench/train/collectives.py projected to 64-4096 GPUs: datasheet NVLink /
InfiniBand link terms (sources stated) and published NCCL all-reduce bus bandwidths to
set the projection against."""

from __future__ import annotations

from bench.train import commcost as cc

# Published / datasheet figures for the projection (per GPU, per direction)
NVLINK = {"beta": 1 / 450e9, "alpha": 2e-6,
          "source": "NVIDIA H100 SXM datasheet: NVLink 900 GB/s bidirectional per GPU "
                    "(450 GB/s each way); alpha 2 us is our assumption"}
IB = {"beta": 1 / 50e9, "alpha": 5e-6,
      "source": "NVIDIA DGX H100 datasheet: 8x ConnectX-7 400 Gb/s (50 GB/s) InfiniBand "
                "NDR, one per GPU; alpha 5 us (switch + NCCL protocol) is our assumption"}
PUBLISHED = {
    "nccl_allreduce_busbw_8xH100_nvlink_GBps": [460, 480],
    "nccl_allreduce_busbw_8xH100_nvlink_source":
        "nccl-tests reference table, docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests "
        "(third-party)",
    "nccl_allreduce_busbw_2x8_H200_4xCX7_roce_GBps": 35,
    "nccl_allreduce_busbw_2x8_H200_source":
        "kubernetes.recipes/recipes/ai/nccl-all-reduce-perf-benchmark-multi-node (third-party)",
}


def project(sizes_gpus: list[int], grad_bytes: float) -> list[dict]:
    """α-β projection to large clusters (8 GPUs per node, one NIC per GPU)."""
    rows = []
    fast = cc.Link(NVLINK["alpha"], NVLINK["beta"])
    slow = cc.Link(IB["alpha"], IB["beta"])
    for g in sizes_gpus:
        net = cc.Net(g // 8, 8, fast, slow, shared_egress=False)
        shared = cc.Net(g // 8, 8, fast, slow, shared_egress=False, contention=2.0)
        row = {"gpus": g, "grad_bytes": grad_bytes}
        costs = {"flat_ring": cc.flat_ring(net, grad_bytes), "tree": cc.tree(net, grad_bytes),
                 "hierarchical": cc.hierarchical(net, grad_bytes),
                 "hierarchical_topk1pct": cc.hierarchical_topk(net, grad_bytes, 0.01, 2),
                 "hierarchical_shared_fabric_x2": cc.hierarchical(shared, grad_bytes)}
        for k, c in costs.items():
            row[f"{k}_s"] = c.seconds
        row["hierarchical_overlap50_exposed_s"] = cc.exposed(costs["hierarchical"], 1.0, 0.5)
        alg = 2 * (g - 1) / g * grad_bytes
        row["busbw_flat_GBps"] = alg / costs["flat_ring"].seconds / 1e9
        row["busbw_hier_GBps"] = alg / costs["hierarchical"].seconds / 1e9
        rows.append(row)
    one = cc.Net(1, 8, fast, slow, shared_egress=False)
    rows.append({"gpus": 8, "note": "one node, NVLink ring",
                 "busbw_flat_GBps": 2 * 7 / 8 * grad_bytes
                 / cc.flat_ring(one, grad_bytes).seconds / 1e9})
    return rows
