"""bench/results/active_learning.json: issue 41's done-when keys from the two parts' files.

The two parts of the active-learning bench run apart (the retrospective one on nci2k for
~37 min on CPU or on a GPU lease, the prospective one with real xTB labels on 2 cores) and
each writes its own result with its own commit, provenance and rules recorded before its
first campaign (``active_learning_retrospective.json``, ``active_learning_prospective.json``
beside the summary). The summary copies their headline keys under the names the issue
reads, names each part's file and commit (``parts``), and takes its own commit and
provenance from the prospective part (the retrospective one's when that is all there is),
as bench/models/science.py's ``write_summary`` does for model_accuracy.json: a number in
it comes from the code at the commit of the part it is copied from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from convergent.core.fsutil import atomic_write_text, dumps_json

#: Copied from the retrospective part (nci2k, labels revealed on selection).
RETROSPECTIVE_KEYS = (
    "labels_ratio_vs_random", "labels_ratio_per_seed",
    "force_labels_ratio_vs_random", "force_labels_ratio_per_seed",
    "oracle_labels_ratio_vs_random", "oracle_labels_ratio_per_seed",
    "oracle_force_labels_ratio_vs_random", "oracle_force_labels_ratio_per_seed",
    "spread_topk_labels_ratio_vs_random", "spread_topk_labels_ratio_per_seed")
#: Copied from the prospective part (real xTB labels, Dask pool).
PROSPECTIVE_KEYS = ("utilisation", "utilisation_sequential", "utilisation_gap", "resume_identical",
                    "prospective_labels_ratio_vs_random", "prospective_labels_ratio_per_seed")
TARGETS = {"labels_ratio_vs_random": "<= 0.5 (median, seeds 0-4)",
           "labels_ratio_per_seed": "<= 0.7 every seed",
           "utilisation": ">= 0.9 and >= utilisation_sequential + 0.1 (same run)",
           "resume_identical": "true"}


def part_paths(out: Path) -> dict[str, Path]:
    """The part files beside the summary ``out`` (``<stem>_<part>.json``)."""
    return {p: out.with_name(f"{out.stem}_{p}.json") for p in ("retrospective", "prospective")}


def _part_row(name: str, path: Path, d: dict[str, Any]) -> dict[str, Any]:
    return {"file": path.name, "commit": d.get("commit"), "dirty": d.get("dirty"),
            "loaded": d.get("loaded"), "complete": d.get("complete"),
            "rules_hash": d.get("rules_hash"), "preset": d.get("preset"),
            "device": (d.get("provenance") or {}).get("device") or d.get("device")}


def done_when(out: dict[str, Any]) -> dict[str, Any]:
    """Each rule of the issue, true/false (None: its part is not there)."""
    retro = (out.get("retrospective_done_when") or {})
    u, us = out.get("utilisation"), out.get("utilisation_sequential")
    return {"labels_ratio_median_le_0.5": retro.get("median_le_0.5"),
            "labels_ratio_every_seed_le_0.7": retro.get("every_seed_le_0.7"),
            "retrospective_seeds": retro.get("seeds"),
            "utilisation_ge_0.9": None if u is None else u >= 0.9,
            "utilisation_gap_ge_0.1": None if u is None or us is None else u - us >= 0.1,
            "resume_identical": out.get("resume_identical")}


def write_summary(out_path: Path) -> dict[str, Any]:
    """Write ``out_path`` from the part files beside it; returns what it wrote."""
    out: dict[str, Any] = {"benchmark": "active_learning", "commit": None, "dirty": None,
                           "loaded": None, "parts": {}}
    parts = {}
    for name, path in part_paths(out_path).items():
        if path.is_file():
            parts[name] = json.loads(path.read_text())
            out["parts"][name] = _part_row(name, path, parts[name])
    if not parts:
        raise FileNotFoundError(f"no part of {out_path.name} beside it: run a --part first")
    top = parts.get("prospective") or parts["retrospective"]
    out.update(commit=top.get("commit"), dirty=any(bool(p.get("dirty")) for p in parts.values()),
               loaded=any(bool(p.get("loaded")) for p in parts.values()))
    out["parts_at_one_commit"] = len({p.get("commit") for p in parts.values()}) == 1
    if "retrospective" in parts:
        r = parts["retrospective"]
        out.update({k: r.get(k) for k in RETROSPECTIVE_KEYS if k in r})
        out["retrospective_done_when"] = r.get("done_when")
        out["retrospective_final"] = r.get("final")  # medians with their spread, per strategy
    if "prospective" in parts:
        p = parts["prospective"]
        out.update({k: p.get(k) for k in PROSPECTIVE_KEYS if k in p})
        out["prospective_utilisation_detail"] = p.get("utilisation_detail")
        out["prospective_final"] = {k: p.get(k) for k in ("energy_mae_per_atom_final", "force_mae_final")}
    out["done_when"] = done_when(out)
    out["targets"] = TARGETS
    out["provenance"] = top.get("provenance")
    atomic_write_text(out_path, dumps_json(out, indent=1) + "\n")
    return out
