"""Name the bottleneck of a run from its metrics, and say what to change."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from convergent.runsdb.trainrecords import TIME_PARTS, TrainStep


@dataclass(frozen=True)
class Finding:
    """One diagnosis line: what dominates, the numbers, and what to change."""

    title: str
    detail: str
    action: str


def step_breakdown(steps: list[TrainStep], skip: int = 2) -> dict[str, float]:
    """Median share of step time spent in each part (data wait, compute, comm, optimizer).

    The first ``skip`` steps (warm-up, allocator growth) are ignored when possible.
    """
    rows = steps[skip:] if len(steps) > skip + 2 else steps
    times = [t for t in (r.times() for r in rows) if t is not None]
    if not times:
        return {}
    totals = {k: float(np.median([t[k] for t in times])) for k in TIME_PARTS}
    whole = sum(totals.values()) or 1.0
    return {k.removesuffix("_s"): v / whole for k, v in totals.items()}


def diagnose(stages: dict[str, Any], steps: list[TrainStep]) -> list[Finding]:
    """Findings, most important first, from stage wall times and per-step metrics."""
    findings: list[Finding] = []
    timed = {k: v["wall_s"] for k, v in stages.items() if "wall_s" in v}
    if timed:
        slowest = max(timed, key=timed.get)
        share = timed[slowest] / sum(timed.values())
        if share > 0.5:
            actions = {
                "simulate": "add workers (cluster.kind=slurm with adapt max), or sample fewer "
                            "frames per molecule and let active learning choose the rest.",
                "train": "raise train.batch_atoms or add processes; try precision.dtype=bf16 on "
                         "GPUs with tensor cores or CPUs with AMX (measure: it can be slower).",
                "screen": "raise screen.batch_atoms so more structures share one forward pass.",
            }
            findings.append(Finding(
                f"{slowest} dominates the run",
                f"{slowest} took {timed[slowest]:.0f} s, {share:.0%} of the stage time.",
                actions.get(slowest, "profile this stage."),
            ))
    bd = step_breakdown(steps)
    if bd:
        if bd["data_wait"] > 0.2:
            findings.append(Finding(
                "training is input-bound",
                f"{bd['data_wait']:.0%} of each step waits for data.",
                "add DataLoader workers, enable the node-local cache tier, or prefetch more.",
            ))
        if bd["comm"] > 0.3:
            findings.append(Finding(
                "training is communication-bound",
                f"{bd['comm']:.0%} of each step is exposed gradient communication.",
                "enable gradient compression (fp16/PowerSGD/top-k), accumulate gradients over "
                "more micro-steps, or use HSDP so shard groups stay inside a node.",
            ))
        mfu = [r.mfu for r in steps if r.mfu]
        if bd["compute"] >= 0.5 and mfu:
            m = float(np.median(mfu))
            if m < 0.2:
                findings.append(Finding(
                    "compute-bound at low utilisation",
                    f"compute is {bd['compute']:.0%} of the step but MFU is {m:.1%}: the "
                    "model's matrices are too small to fill the cores.",
                    "raise train.batch_atoms or the model width; measure precision.dtype=bf16.",
                ))
    return findings
