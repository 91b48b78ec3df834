"""The architecture holds: layers, no import cycles, leaf config schemas, small modules.

The layer and cycle contracts live in pyproject.toml (`[tool.importlinter]`) and are run
here with import-linter's own command, exactly as `lint-imports` runs them by hand.

Size rule: no module in src/, bench/, scripts/ or tests/ is over MAX_LINES lines unless its first line is a comment
`# size: <one-line reason>` saying why it is one job all the same. No function in src/
(nested ones included) is over MAX_FUNCTION_LINES lines; ruff's PLR0915 (pyproject.toml)
bounds their statements as well.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
MAX_LINES = 500
MAX_FUNCTION_LINES = 80
SIZE_MARK = "# size:"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def test_import_contracts_hold():
    exe = Path(sys.executable).with_name("lint-imports")
    # where the console script is missing (a GPU machine's image), its entry point itself:
    # `python -m importlinter.cli` would import the module, run nothing and exit 0
    cmd = [str(exe)] if exe.exists() else [
        sys.executable, "-c",
        "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"]
    proc = subprocess.run(
        [*cmd, str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = proc.stdout + proc.stderr
    print(report)
    assert proc.returncode == 0, "import contracts broken:\n" + report
    # the contracts really ran: a config that silently checked nothing would also exit 0
    assert "Contracts: 2 kept, 0 broken." in report, report


def test_section_schemas_are_leaves():
    """`convergent.config` composes `<package>/config.py`; the layer contract ignores those
    edges, which is only sound while each section schema imports nothing of the project
    but the layers below `convergent.config` (core/ and cluster/: `convergent.core.configbase`,
    `convergent.cluster.config`, ...): otherwise the ignore could hide an upward chain."""
    graph = grimp.build_graph("convergent")  # src/ is on sys.path (pyproject.toml: pythonpath)
    sections = sorted(m for m in graph.modules if m.count(".") == 2 and m.endswith(".config"))
    assert len(sections) >= 8, sections
    bad = {
        m: sorted(
            i for i in graph.find_modules_directly_imported_by(m) if i.startswith("convergent")
        )
        for m in sections
    }
    core = {m for m in graph.modules if m.startswith(("convergent.core.", "convergent.cluster."))}
    assert "convergent.core.configbase" in core, sorted(core)
    bad = {m: deps for m, deps in bad.items() if set(deps) - core}
    assert not bad, f"section schemas importing above core/cluster: {bad}"


def test_modules_are_small_or_say_why():
    too_big = []
    bench = [p for p in (ROOT / "bench").rglob("*.py")  # not bench/data/ (generated, ignored)
             if p.relative_to(ROOT / "bench").parts[0] not in ("data", "results")]
    files = [*SRC.rglob("*.py"), *bench, *(ROOT / "scripts").glob("*.py"),
             *(ROOT / "tests").rglob("*.py")]
    for path in sorted(files):
        lines = path.read_text().splitlines()
        if len(lines) > MAX_LINES and not (lines and lines[0].startswith(SIZE_MARK)):
            too_big.append(f"{path.relative_to(ROOT)}: {len(lines)} lines")
    assert not too_big, (
        f"modules over {MAX_LINES} lines without a first line '{SIZE_MARK} <reason>':\n"
        + "\n".join(too_big)
    )


def test_functions_are_short():
    """Every function in src/convergent, nested ones included, is at most MAX_FUNCTION_LINES
    lines (decorators not counted, docstring included)."""
    too_long = []
    for path in sorted((SRC / "convergent").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not too_long, (
        f"functions over {MAX_FUNCTION_LINES} lines (split them by responsibility):\n"
        + "\n".join(too_long)
    )
