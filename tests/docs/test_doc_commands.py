"""Issue 38, item 7: every console command in the README and docs/ runs as written.

Each ``$ .venv/bin/convergent ...`` line of a ``console`` block is checked the cheap way:
its command (and sub-command) exists and takes every ``--option`` the line uses (read
from ``--help``, run in-process); a documented mistake — a line followed by ``error: …``
— prints that line and exits 2 (unless its comment says it happens elsewhere, "# on a
1-GPU node"); ``--print-launch`` lines and ``--help`` lines run for real. What a command then computes is the business of its own tests.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PREFIX = ".venv/bin/convergent"


def _commands() -> list[tuple[str, int, list[str], str | None]]:
    """(page, line, argv, the documented error line or None) of every convergent command."""
    out = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        inside = False
        i = 0
        while i < len(lines):
            line = lines[i]
            if line.startswith("```"):
                inside = line.strip() == "```console" if not inside else False
            elif inside and line.startswith(f"$ {PREFIX}"):
                start = i
                text = line[2:]
                while text.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text.rstrip()[:-1] + " " + lines[i].strip()
                comment = re.search(r"\s#\s*(.*)$", text)
                text = re.sub(r"\s+#.*$", "", text)  # a trailing comment
                nxt = lines[i + 1] if i + 1 < len(lines) else ""
                # an error shown for another machine ("# on a 1-GPU node") is not checked here
                elsewhere = comment is not None and comment.group(1).startswith("on ")
                err = nxt if nxt.startswith("error:") and not elsewhere else None
                argv = shlex.split(text.split("&&")[0].split(";")[0])[1:]
                out.append((page.name, start + 1, argv, err))
            i += 1
    return out


COMMANDS = _commands()


def test_the_pages_hold_commands():
    assert len(COMMANDS) > 30
    assert {p for p, *_ in COMMANDS} >= {"README.md", "cli.md", "cluster.md", "serving.md"}


def _run(argv: list[str], capsys) -> tuple[int, str, str]:  # noqa: ANN001
    from convergent.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:  # cyclopts' --help and parse errors
        code = exc.code if isinstance(exc.code, int) else 0
    out = capsys.readouterr()
    return int(code or 0), out.out, out.err


def _help(words: list[str], capsys) -> tuple[int, str, str]:  # noqa: ANN001
    code, out, err = _run([*words, "--help"], capsys)
    return code, re.sub(r"\s+", " ", out), err


def _command_path(argv: list[str], capsys) -> tuple[list[str], str]:  # noqa: ANN001
    """The command words of ``argv`` (a command, and a sub-command where it has them) and
    that command's help text."""
    words = argv[:1]
    code, text, err = _help(words, capsys)
    assert code == 0, (words, err)
    if len(argv) > 1 and "Commands" in text and re.match(r"^[a-z][a-z-]*$", argv[1]):
        code, sub, err = _help(argv[:2], capsys)
        if code == 0 and sub != text:
            return argv[:2], sub
    return words, text


@pytest.mark.parametrize("page,line,argv,err", COMMANDS,
                         ids=[f"{p}:{n}" for p, n, _, _ in COMMANDS])
def test_a_documented_command_runs_as_written(page, line, argv, err, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing a command might write lands in the checkout
    if err is not None:
        code, _, stderr = _run(argv, capsys)
        assert code == 2 and stderr.strip().splitlines()[0] == err, (page, line, stderr)
        return
    if "--print-launch" in argv and "--submit" not in argv or argv[-1:] == ["--help"]:
        code, out, stderr = _run(argv, capsys)
        assert code == 0, (page, line, stderr)
        return
    words, helptext = _command_path(argv, capsys)
    for opt in {a.split("=", 1)[0] for a in argv if a.startswith("--")}:
        if opt in ("--help", "--set", "-s"):
            continue
        assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", helptext), \
            f"{page}:{line}: `convergent {' '.join(words)}` has no option {opt}"


BENCH_MODULE = re.compile(r"(?<![\w/.-])bench(?:\.[a-z_]\w*)+")
BENCH_FILE = re.compile(r"(?<![\w/.-])bench/(?:[\w-]+/)*[\w-]+\.py\b")


def test_every_bench_the_pages_name_is_in_the_checkout():
    """A bench the README, docs/ or the Makefile names — as a module (``python -m
    bench.train.throughput``, ``bench.lib.harness``) or a file (``bench/models/molbench.py``)
    — exists: a bench that moves takes its documentation along."""
    missing = []
    for page in [*PAGES, ROOT / "Makefile"]:
        text = page.read_text(encoding="utf-8")
        names = [(m, m.replace(".", "/") + ".py") for m in BENCH_MODULE.findall(text)]
        names += [(f, f) for f in BENCH_FILE.findall(text)]
        missing += [f"{page.name}: {shown}" for shown, path in names if not (ROOT / path).is_file()]
    assert not missing, missing
