"""The results table of docs/benchmarks.md, generated from bench/results/*.json.

One row per result file: the bench, the commit it ran at, the machine (CPU and its AMX /
AVX-512 flags, the GPU), when, whether it was measured under load, and its headline
numbers as the file states them. ``python -m bench.tables`` rewrites the table between
the markers in docs/benchmarks.md; ``--check`` exits 1 when the page is out of date
(tests/test_bench_results.py runs the same check).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.lib.paths import REPO, RESULTS

PAGE = REPO / "docs" / "benchmarks.md"
START, END = "<!-- results-table:start -->", "<!-- results-table:end -->"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in list(v.items())[:6]) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v[:6]) + (", …" if len(v) > 6 else "") + "]"
    return str(v)


def _machine(data: dict[str, Any]) -> str:
    m = (data.get("provenance") or {}).get("machine") or data.get("machine") or {}
    flags = m.get("cpu_flags") or {}
    isa = "AMX" if flags.get("amx_tile") else "AVX-512" if flags.get("avx512f") else ""
    parts = [str(m.get("cpu") or m.get("cpu_model") or "?") + (f" ({isa})" if isa else "")]
    if m.get("cores"):
        parts.append(f"{m['cores']} cores")
    gpu = m.get("gpu")
    if gpu:
        parts.append(str(gpu.get("name") if isinstance(gpu, dict) else gpu))
    return ", ".join(parts)


SUMMARY_KEYS = ("labels_ratio_vs_random", "utilisation", "utilisation_sequential",
                "resume_identical")
NOT_HEADLINE = {"complete", "settings", "utilisation_settings", "seeds", "settings_changed_by_set",
                "preset", "rules", "rules_hash", "targets", "rules_written_utc"}


def row(path: Path) -> str:
    data = json.loads(path.read_text())
    head = data.get("headline")
    if head is None and "done_when" in data:  # a summary of parts (active_learning.json)
        head = {k: data[k] for k in SUMMARY_KEYS if k in data}
    if isinstance(head, dict):
        keys = [k for k in head if not k.endswith(("per_seed", "per_fold", "per_round"))
                and k not in NOT_HEADLINE][:3]
        numbers = "; ".join(f"{k} = {_fmt(head[k])}" for k in keys)
    else:
        numbers = _fmt(head) if head else "(see the file)"
    if len(numbers) > 240:
        numbers = numbers[:240].rsplit(" ", 1)[0] + " …"
    when = ((data.get("provenance") or {}).get("started_utc") or data.get("time_utc") or "")[:10]
    loaded = "**loaded: not quoted**" if data.get("loaded") else ""
    commit = str(data.get("commit") or "?")[:7]
    return (f"| `{path.name}` | {commit} | {_machine(data)} | {when} | {loaded} | "
            f"{numbers.replace('|', '/')} |")


def table() -> str:
    lines = ["| file | commit | machine | date | load | headline |", "|---|---|---|---|---|---|"]
    lines += [row(p) for p in sorted(RESULTS.glob("*.json"))]
    return "\n".join(lines)


def render(page: str) -> str:
    a, b = page.index(START) + len(START), page.index(END)
    return page[:a] + "\n" + table() + "\n" + page[b:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    args = ap.parse_args()
    page = PAGE.read_text(encoding="utf-8")
    new = render(page)
    if args.check:
        if new != page:
            print(f"{PAGE}: the results table is out of date; run python -m bench.tables",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
