"""The one discipline every benchmark in bench/ follows.

A benchmark compares *sides* (ours and one or more peers, or several settings of ours).
This module gives it:

* :func:`provenance` — git commit + dirty flag of the checkout, package versions, the
  machine (CPU model, cores, memory, GPU if any) and the load average;
* :func:`interleave` — run the sides A B C A B C … for ``rounds`` rounds, so slow drift of
  the machine (other jobs, thermal, page cache) lands on every side alike;
* :func:`summarise` — median with its spread (min, max, IQR) of each metric, never best-of;
* :class:`Result` / :func:`write_result` — one JSON per bench with ``commit`` at the top,
  each side's exact settings, the differences that remain between sides stated in words,
  and a refusal to write from a dirty tree unless ``--allow-dirty`` is given (the result
  then says so);
* :class:`LoadGuard` (started by :func:`check_clean`) — a benchmark runs alone: when the
  1-minute load average is above half the cores at the start (after waiting up to
  ``--settle`` seconds for it to fall), or processes outside the benchmark's own process
  tree take more than a quarter of the machine's CPU time during the run, no result is
  written to ``bench/results/`` (one line, exit 2) unless ``--allow-load``, which marks the
  file ``loaded: true``. A file written elsewhere (``--out /tmp/x.json``) is marked too,
  never refused.

Use::

    from bench.lib.harness import Side, add_args, interleave, write_result
    ap = argparse.ArgumentParser(); add_args(ap, default_out="bench/results/x.json")
    args = ap.parse_args()
    check_clean(args)                      # fail fast, before minutes of work
    sides = [Side("ours", run_ours, {"threads": 2}), Side("peer", run_peer, {"threads": 2})]
    res = interleave("x", sides, rounds=args.rounds)
    res.headline["speedup"] = res.ratio("ours", "peer", "samples_per_s")
    write_result(res, args)

Each side's callable takes the round number and returns a dict ``metric -> float`` (other
JSON values are kept per round but not summarised). A round that failed returns a dict
with an ``"error"`` key: it is kept in ``per_round`` but left out of the summary (a failed
run's wall time is no measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.lib.load import LoadGuard
from bench.lib.paths import REPO as ROOT
from bench.lib.paths import RESULTS

_GUARD: LoadGuard | None = None  # started by check_clean, read by write_result
_START_LOAD: list[float] | None = None  # the load average when check_clean let the run start
PACKAGES = ("convergent", "torch", "numpy", "dask", "distributed", "tblite", "pyscf", "ase",
            "transformers", "tokenizers", "pyarrow", "rdkit", "mlflow")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_state() -> dict[str, Any]:
    """Commit of the checkout and whether tracked files differ from it."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": _git("rev-parse", "HEAD"), "dirty": bool(status),
            "dirty_files": status.splitlines() if status else []}


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


# the ISA features that change which kernels ATen and oneDNN pick (and so the numbers)
ISA_FLAGS = ("amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "avx512_fp16", "avx512_bf16",
             "avx512_vnni", "avx512f", "avx2", "fma")


def cpu_info() -> tuple[str, dict[str, bool]]:
    """The CPU model and which of :data:`ISA_FLAGS` it has (from /proc/cpuinfo)."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    cpu = model or platform.processor() or ""
    return cpu, {f: f in flags for f in ISA_FLAGS}


def machine() -> dict[str, Any]:
    cpu, flags = cpu_info()
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        pass
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return {"host": platform.node(), "cpu": cpu, "cpu_flags": flags,
            "cores": len(os.sched_getaffinity(0)),
            "memory_gib": round(mem, 1) if mem else None, "gpu": gpu,
            "os": platform.platform()}


def provenance() -> dict[str, Any]:
    """Where a result came from. ``load_avg_before`` is the load when the run started (the
    reading :func:`check_clean` settled on, before the bench's own set-up); a bench that calls
    this after its set-up also gets the load then, as ``load_avg_after_setup``."""
    now = list(os.getloadavg())
    prov = {**git_state(), "versions": versions(), "machine": machine(),
            "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
            "load_avg_before": _START_LOAD or now}
    if _START_LOAD is not None:
        prov["load_avg_after_setup"] = now
    return prov


def summarise(values: list[float]) -> dict[str, Any]:
    """Median and spread of one metric over rounds (never best-of)."""
    vals = sorted(float(v) for v in values)
    if not vals:
        return {"n": 0, "median": None}
    if len(vals) >= 4:
        q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive")
    else:
        q1, q3 = vals[0], vals[-1]
    return {"n": len(vals), "median": statistics.median(vals), "min": vals[0],
            "max": vals[-1], "q1": q1, "q3": q3, "values": [float(v) for v in values]}


@dataclass
class Side:
    """One side of a comparison: a name, a callable run once per round, its settings."""

    name: str
    run: Callable[[int], dict[str, Any]]
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class Result:
    benchmark: str
    provenance: dict[str, Any]
    rounds: int
    settings: dict[str, dict[str, Any]]
    per_round: dict[str, list[dict[str, Any]]]
    summary: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    differences: list[str] = field(default_factory=list)
    headline: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def median(self, side: str, metric: str) -> float | None:
        return self.summary.get(side, {}).get(metric, {}).get("median")

    def ratio(self, a: str, b: str, metric: str) -> float | None:
        """Ratio of medians a/b of ``metric`` (None when either is missing or b is 0)."""
        x, y = self.median(a, metric), self.median(b, metric)
        return None if x is None or not y else x / y

    def summarise(self) -> None:
        self.summary = {}
        for side, rows in self.per_round.items():
            metrics: dict[str, list[float]] = {}
            for row in rows:
                if "error" in row:
                    continue
                for key, value in row.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        metrics.setdefault(key, []).append(value)
            self.summary[side] = {k: summarise(v) for k, v in metrics.items()}

    def to_dict(self) -> dict[str, Any]:
        """The JSON: ``benchmark``, ``commit``, ``dirty`` first, then the headline keys, then
        the harness's fields. A headline key that a bench kept from before the harness and
        that has the name of a field (e.g. ``summary``) wins; that field is then written as
        ``harness_<name>``."""
        d = asdict(self)
        for name in [k for k in d if k in self.headline and k != "headline"]:
            d[f"harness_{name}"] = d.pop(name)
        # the commit at the top level, where readers (and issue checks) look first
        return {"benchmark": self.benchmark, "commit": self.provenance.get("commit"),
                "dirty": self.provenance.get("dirty"), **d, **self.headline}


def interleave(benchmark: str, sides: list[Side], rounds: int, warmup: int = 0,
               differences: list[str] | None = None, progress: bool = True) -> Result:
    """Run every side once per round, in the same order each round (A B C A B C …).

    ``warmup`` extra rounds run first and are discarded (imports, caches, JIT).
    """
    if len({s.name for s in sides}) != len(sides):
        raise ValueError("side names must be unique")
    res = Result(benchmark=benchmark, provenance=provenance(), rounds=rounds,
                 settings={s.name: s.settings for s in sides},
                 per_round={s.name: [] for s in sides}, differences=list(differences or []))
    for r in range(-warmup, rounds):
        for side in sides:
            t0 = time.perf_counter()
            row = dict(side.run(r) or {})
            if "error" not in row:
                row.setdefault("wall_s", time.perf_counter() - t0)
            row["load1"] = os.getloadavg()[0]
            if r >= 0:
                row["round"] = r
                res.per_round[side.name].append(row)
            if progress:
                tag = "warmup" if r < 0 else f"round {r + 1}/{rounds}"
                print(f"[{benchmark}] {tag} {side.name}: "
                      + ", ".join(f"{k}={v:.4g}" for k, v in row.items()
                                  if isinstance(v, float)), file=sys.stderr, flush=True)
    res.provenance["load_avg_after"] = list(os.getloadavg())
    res.provenance["finished_utc"] = datetime.now(UTC).isoformat(timespec="seconds")
    res.summarise()
    return res


def add_args(ap: argparse.ArgumentParser, default_out: str, rounds: int = 5) -> None:
    ap.add_argument("--rounds", type=int, default=rounds,
                    help=f"interleaved rounds per side (default {rounds})")
    ap.add_argument("--out", default=default_out, help="result JSON path")
    ap.add_argument("--allow-dirty", action="store_true",
                    help="write a result even though tracked files differ from the commit "
                         "(the JSON then says dirty: true)")
    ap.add_argument("--allow-load", action="store_true",
                    help="write to bench/results/ even though the machine was busy (load "
                         "average above half the cores at the start, or other processes took "
                         "over a quarter of the CPU); the JSON then says loaded: true")
    ap.add_argument("--settle", type=float, default=150.0, metavar="S",
                    help="seconds to wait at the start for the 1-minute load average to fall "
                         "below half the cores (default 150)")


def _refuse(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _to_results(args: argparse.Namespace) -> bool:
    """Whether ``--out`` lies in bench/results/ (the files the README may quote)."""
    out = Path(getattr(args, "out", "") or ".").resolve()
    return out == RESULTS or RESULTS in out.parents


def _check_dirty(args: argparse.Namespace) -> None:
    state = git_state()
    if state["dirty"] and not getattr(args, "allow_dirty", False):
        files = ", ".join(state["dirty_files"][:5])
        _refuse(f"the working tree has uncommitted changes ({files}); a result must come "
                "from a commit — commit first, or pass --allow-dirty")


def check_clean(args: argparse.Namespace) -> None:
    """Refuse (exit 2) before any work when the tree is dirty and --allow-dirty is not set,
    or when a result for bench/results/ would start on a busy machine (unless --allow-load);
    then start the :class:`LoadGuard` that :func:`write_result` reads."""
    global _GUARD, _START_LOAD
    _check_dirty(args)
    guard = LoadGuard()
    if _to_results(args):
        load = guard.settle(getattr(args, "settle", 150.0))
        if load > guard.max_load and not getattr(args, "allow_load", False):
            _refuse(f"1-minute load average {load:.2f} > {guard.max_load:g} (half of "
                    f"{guard.cores} cores): the machine is busy; run the benchmark alone, "
                    "or pass --allow-load (the result is then marked loaded: true)")
    else:
        guard.load_start = os.getloadavg()[0]
    _START_LOAD = list(os.getloadavg())
    if _GUARD is not None:
        _GUARD.stop()
    _GUARD = guard.start()


def _mark_load(data: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Put the guard's record into the result (``loaded`` on top, the detail in the
    provenance); refuse a busy run's result for bench/results/ unless --allow-load."""
    if _GUARD is None:
        if _to_results(args):
            _refuse("no load guard ran (call check_clean(args) before the work); "
                    f"nothing written to {args.out}")
        return data
    rec = _GUARD.report()
    if rec["loaded"] and _to_results(args) and not getattr(args, "allow_load", False):
        _refuse(f"{rec['reasons'][0]}; nothing written to {args.out} — run the benchmark "
                "alone, or pass --allow-load (the result is then marked loaded: true)")
    head = {k: data[k] for k in ("benchmark", "commit", "dirty") if k in data}
    out = {**head, "loaded": rec["loaded"], **{k: v for k, v in data.items() if k not in head}}
    if isinstance(out.get("provenance"), dict):
        out["provenance"] = {**out["provenance"], "load_guard": rec}
    else:
        out["load_guard"] = rec
    return out


def stamp(benchmark: str, prov: dict[str, Any], data: dict[str, Any],
          differences: list[str] | None = None) -> dict[str, Any]:
    """A result for a bench that drives its own rounds (not :func:`interleave`): ``commit``
    and ``dirty`` at the top, then ``data``, the stated ``differences`` and the provenance
    (``prov`` from :func:`provenance` at the start, completed here with the load after)."""
    prov = dict(prov)
    prov.setdefault("load_avg_after", list(os.getloadavg()))
    prov.setdefault("finished_utc", datetime.now(UTC).isoformat(timespec="seconds"))
    return {"benchmark": benchmark, "commit": prov.get("commit"), "dirty": prov.get("dirty"),
            **data, "differences": list(differences or []), "provenance": prov}


def spread(values: list[float]) -> dict[str, Any]:
    """:func:`summarise` of the values that are not None (None: a side failed that round)."""
    return summarise([v for v in values if v is not None])


def write_result(res: Result | dict[str, Any], args: argparse.Namespace) -> Path:
    """Write the result JSON atomically, refusing a dirty tree unless --allow-dirty and, for
    bench/results/, a busy machine unless --allow-load."""
    _check_dirty(args)
    data = res.to_dict() if isinstance(res, Result) else res
    if "commit" not in data:
        raise ValueError("a result must carry its commit (use provenance())")
    data = _mark_load(data, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}", file=sys.stderr)
    return out


def stamp_png(path: str | Path, commit: str | None, benchmark: str) -> None:
    """Write the commit a figure was made at into the PNG itself (a ``tEXt`` chunk
    ``convergent-commit``), so every file in bench/results names its code version."""
    from PIL import Image, PngImagePlugin

    path = Path(path)
    info = PngImagePlugin.PngInfo()
    info.add_text("convergent-commit", commit or "unknown")
    info.add_text("convergent-benchmark", benchmark)
    with Image.open(path) as img:
        img.load()
        tmp = path.with_name(f".{path.name}.tmp")
        img.save(tmp, format="PNG", pnginfo=info)
    os.replace(tmp, path)


def png_commit(path: str | Path) -> str | None:
    """The commit :func:`stamp_png` wrote into a PNG (None if it has none)."""
    from PIL import Image

    with Image.open(path) as img:
        return img.text.get("convergent-commit")  # type: ignore[attr-defined]
