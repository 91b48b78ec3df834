"""Every sub-command meets a user's mistakes with one line ``error: ...`` and exit code 2.

The commands are enumerated from the Typer app itself, so a command added later is
walked too: a mistyped option (with its did-you-mean hint), a missing argument (or an
option given without its value) and a bad value. In-process through ``main(argv)``;
two real subprocesses check that no traceback reaches the terminal.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import typer

from convergent.cli import app, main
from tests.cli_exe import EXE


def _leaves(cmd, path=()):
    subs = getattr(cmd, "commands", None)
    if subs:
        for name in sorted(subs):
            yield from _leaves(subs[name], (*path, name))
    else:
        yield path, cmd


ROOT = typer.main.get_command(app)
COMMANDS = {" ".join(path): cmd for path, cmd in _leaves(ROOT)}
GROUPS = [(), *sorted({p[:i] for p in (tuple(k.split()) for k in COMMANDS) for i in range(1, len(p))})]


def _kind(param) -> str:
    """int | float | bool | path | str | list, for click and Typer's vendored click."""
    if getattr(param, "is_flag", False):
        return "bool"
    t = getattr(param, "type", None)
    # by class first: the type's display name differs between click versions (a GPU image's)
    classes = {c.__name__ for c in type(t).__mro__}
    if classes & {"IntParamType", "IntRange"}:
        return "int"
    if classes & {"FloatParamType", "FloatRange"}:
        return "float"
    if t is not None and hasattr(t, "name"):
        name = str(t.name).lower()
        return {"integer": "int", "integer range": "int", "float": "float",
                "float range": "float", "path": "path", "boolean": "bool"}.get(name, "str")
    bare = getattr(param, "bare_type", None)
    name = str(bare() if callable(bare) else bare).lower()
    return {"int": "int", "float": "float", "bool": "bool", "path": "path"}.get(name, "str")


def _options(cmd):
    return [p for p in cmd.params if p.param_type_name == "option" and not getattr(p, "hidden", False)]


def _placeholders(cmd, skip=None) -> list[str]:
    """Values for the required arguments and options (paths that do not exist)."""
    args: list[str] = []
    for p in cmd.params:
        if p is skip or not p.required:
            continue
        value = "/nonexistent/x" if _kind(p) in ("path", "str") else "1"
        args += [p.opts[0], value] if p.param_type_name == "option" else [value]
    return args


def _one_error_line(capsys, argv: list[str], code: int) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, f"{argv}: exit code {code}, stderr {err!r}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{argv}: {err!r}"
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def empty_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    assert list(tmp_path.iterdir()) == [], "a failed start must leave nothing behind"


def test_the_walk_covers_every_stage():
    assert {"demo", "simulate", "relabel", "train", "screen", "report", "serve", "generate",
            "bench-serve", "data pack", "data inspect", "data verify", "data export",
            "data cache"} <= set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_mistyped_option(name, capsys, empty_cwd):
    cmd = COMMANDS[name]
    longs = [o for p in _options(cmd) for o in p.opts if o.startswith("--") and len(o) >= 7]
    opt = longs[0] if longs else "--help"
    typo = opt[:4] + opt[5:] if longs else "--hlep"
    argv = [*name.split(), typo, "1"]
    line = _one_error_line(capsys, argv, main(argv))
    assert f"no such option {typo}" in line and f"did you mean {opt}" in line, line


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: " ".join(g) or "convergent")
def test_mistyped_command(group, capsys, empty_cwd):
    cmd = ROOT
    for part in group:
        cmd = cmd.commands[part]
    real = sorted(cmd.commands)[0]
    typo = real[:1] + real[2:] if len(real) > 3 else real + "x"
    argv = [*group, typo]
    line = _one_error_line(capsys, argv, main(argv))
    assert f"no such command '{typo}'" in line, line


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_missing_argument(name, capsys, empty_cwd):
    cmd = COMMANDS[name]
    required = [p for p in cmd.params if p.required]
    valued = [p for p in _options(cmd) if _kind(p) != "bool" and not p.required]
    if required:  # leave the first required parameter out
        miss = required[0]
        argv = [*name.split(), *_placeholders(cmd, skip=miss)]
        line = _one_error_line(capsys, argv, main(argv))
        assert f"missing {miss.param_type_name}" in line, line
    elif valued:  # an option given without its value
        opt = valued[0].opts[0]
        argv = [*name.split(), opt]
        line = _one_error_line(capsys, argv, main(argv))
        assert opt in line and "requires an argument" in line, line
    else:
        pytest.skip(f"{name} takes no argument and no option with a value")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_bad_value(name, capsys, empty_cwd):
    cmd = COMMANDS[name]
    numeric = [p for p in _options(cmd) if _kind(p) in ("int", "float")]
    has_set = any("--set" in p.opts for p in _options(cmd))
    paths = [p for p in cmd.params if p.param_type_name == "argument" and _kind(p) == "path"]
    if numeric:
        opt = numeric[0].opts[0]
        argv = [*name.split(), opt, "abc", *_placeholders(cmd)]
        line = _one_error_line(capsys, argv, main(argv))
        assert f"invalid value for '{opt}'" in line and "'abc'" in line, line
    elif has_set:
        argv = [*name.split(), "--set", "train.steps=-5", *_placeholders(cmd)]
        line = _one_error_line(capsys, argv, main(argv))
        assert "train.steps" in line, line
    elif paths:
        argv = [*name.split(), *_placeholders(cmd)]
        line = _one_error_line(capsys, argv, main(argv))
        assert "/nonexistent/x" in line, line
    else:
        pytest.skip(f"{name} takes no value that can be wrong")


@pytest.mark.parametrize("argv, needle", [
    (["train", "--set", "train.steps=-5"], "train.steps"),
    (["simulate", "--set", "simulate.frames=0", "--workers", "1"], "simulate.frames"),
    (["demo", "--set", "data.shard_bytes=12"], "data.shard_bytes"),
    (["screen", "--set", "screen.batch_atoms=0"], "screen.batch_atoms"),
    (["serve", "--set", "serve.http.port=70000"], "serve.http.port"),
    (["data", "pack", "/nonexistent/x"], "/nonexistent/x"),
    (["train", "--set", "train.dataset=/nonexistent/x"], "/nonexistent/x"),
    (["train", "--set", "parallel.rdzv_endpoint=nohostport"], "parallel.rdzv_endpoint"),
])
def test_bounds_and_inputs_are_checked_before_anything_is_created(argv, needle, capsys, empty_cwd):
    line = _one_error_line(capsys, argv, main(argv))
    assert needle in line, line


def test_a_busy_port_is_refused_before_serve_loads_anything(capsys, empty_cwd):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        argv = ["serve", "--port", str(port)]
        line = _one_error_line(capsys, argv, main(argv))
    assert f"cannot listen on 127.0.0.1:{port}" in line, line


def test_debug_shows_the_traceback_of_a_usage_error(capsys):
    from convergent.cli.errors import USAGE_ERRORS

    with pytest.raises(USAGE_ERRORS):
        main(["--debug", "simulate", "--frmes", "10"])


def _run(args, cwd):
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([EXE, *args], capture_output=True, text=True, cwd=cwd, timeout=300,
                          env=env)


def test_real_process_prints_one_line_for_a_typo(tmp_path):
    out = _run(["simulate", "--frmes", "10"], tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == ("error: convergent simulate: no such option --frmes "
                                  "(hint: did you mean --frames?)")


LM = ["--set", "model.kind=llama", "--set", "model.hidden=16", "--set", "model.layers=1",
      "--set", "model.heads=2", "--set", "train.seq_len=8", "--set", "train.vocab_size=32",
      "--set", "train.global_batch_seqs=2", "--set", "parallel.strategy=single",
      "--set", "metrics.tensorboard=false", "--set", "train.val_every=0"]


def test_real_process_bad_steps_then_the_fixed_command_runs(tmp_path):
    bad = _run(["train", *LM, "--set", "train.steps=-5"], tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.steps" in lines[0] and lines[0].startswith("error: ")
    assert not (tmp_path / "runs").exists()
    good = _run(["train", *LM, "--set", "train.steps=2"], tmp_path)
    assert good.returncode == 0, good.stderr
    assert "trained 2 steps" in good.stdout and (tmp_path / "runs" / "train" / "ckpt").is_dir()


def test_other_failures_are_one_line_too(capsys):
    from pydantic import ValidationError

    from convergent.cli.errors import report
    from convergent.config import ConvergentConfig

    cfg = ConvergentConfig()
    with pytest.raises(ValidationError) as err:  # a validated assignment deep in a stage
        cfg.train.steps = -1
    assert report(err.value, []) == 2
    assert capsys.readouterr().err == ("error: invalid value for 'steps': input should be "
                                       "greater than or equal to 1 (got -1)\n")
    try:
        open("/nonexistent/dir/file")  # noqa: SIM115
    except OSError as exc:
        assert report(exc, []) == 2
    assert capsys.readouterr().err == "error: /nonexistent/dir/file: No such file or directory\n"
    assert report(ZeroDivisionError("division by zero"), []) == 1  # a bug: exit 1, still one line
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: internal error: ZeroDivisionError")
    assert "--debug" in err
