"""How the command line reports a failure: one line ``error: ...`` on stderr, exit code 2.

Click/Typer usage errors (unknown option or command, a value of the wrong type, a
missing argument), pydantic validation errors and :class:`~convergent.core.errors.ConvergentError`
all become one line with a hint (``did you mean --frames?`` from difflib close matches
against the command's own options and sub-commands). Anything else is a bug: one line
naming the exception, exit code 1, and ``--debug`` shows the traceback.

Typer >= 0.20 vendors click as ``typer._click``; older versions use ``click`` itself, so
the exception classes are looked up in both.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Sequence
from typing import Any

import typer

from convergent.core.errors import ConvergentError


def _click_modules() -> list[Any]:
    mods = []
    try:
        import click.exceptions as ce

        mods.append(ce)
    except ImportError:  # pragma: no cover - typer >= 0.20 does not need click
        pass
    vendored = getattr(getattr(typer, "_click", None), "exceptions", None)
    if vendored is None:
        try:
            import typer._click.exceptions as vendored  # type: ignore[no-redef]
        except ImportError:
            vendored = None
    if vendored is not None and vendored not in mods:
        mods.append(vendored)
    return mods


def _classes(name: str) -> tuple[type[BaseException], ...]:
    found = [getattr(m, name) for m in _click_modules() if hasattr(m, name)]
    return tuple(dict.fromkeys(found))


USAGE_ERRORS = _classes("UsageError")
CLICK_ERRORS = _classes("ClickException")
ABORTS = tuple(dict.fromkeys((*_classes("Abort"), typer.Abort)))
EXITS = tuple(dict.fromkeys((*_classes("Exit"), typer.Exit)))


def one_line(text: str) -> str:
    """Collapse a multi-line message into one line (parts joined by ``; ``)."""
    parts = [p.strip() for p in str(text).splitlines() if p.strip()]
    return "; ".join(parts)


def error_line(message: str, hint: str | None = None) -> str:
    """The single stderr line: ``error: MESSAGE (hint: HINT)``."""
    line = f"error: {one_line(message)}"
    if hint:
        line += f" (hint: {one_line(hint)})"
    return line


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:] if text[:1].isupper() and text[1:2].islower() else text


def _option_names(command: Any) -> list[str]:
    names: list[str] = []
    for p in getattr(command, "params", []):
        if getattr(p, "param_type_name", "") == "option":
            names += [*p.opts, *getattr(p, "secondary_opts", [])]
    names += ["--help", "-h"]
    return names


def _did_you_mean(word: str, choices: Sequence[str]) -> str | None:
    scored = sorted(((difflib.SequenceMatcher(None, word, c).ratio(), c) for c in set(choices)),
                    reverse=True)
    scored = [(r, c) for r, c in scored if r >= 0.6]
    if not scored:
        return None
    matches = [c for r, c in scored[:3] if r >= scored[0][0] - 0.05]
    return "did you mean " + " or ".join(matches) + "?"


def _given_value(argv: Sequence[str], param: Any) -> str | None:
    """The raw text the user gave for option ``param`` (for ``(got 'abc')``)."""
    opts = list(getattr(param, "opts", []))
    if getattr(param, "param_type_name", "") != "option":
        return None
    for i, tok in enumerate(argv):
        for o in opts:
            if tok == o and i + 1 < len(argv):
                return argv[i + 1]
            if o.startswith("--") and tok.startswith(o + "="):
                return tok[len(o) + 1 :]
    return None


def _named_path(ctx: Any, argv: Sequence[str], root: Any = None) -> tuple[str, Any]:
    """(command path, command) of the sub-command ``argv`` names, from ``ctx`` (or the
    ``root`` command) down: some parser errors carry no context or the root's."""
    if ctx is None:
        path, command = "convergent", root
    else:
        path, command = ctx.command_path, ctx.command
    for tok in argv:
        subs = getattr(command, "commands", None)
        if not subs:
            break
        if tok in subs:
            path, command = f"{path} {tok}", subs[tok]
    return path, command


def usage_error(exc: Any, argv: Sequence[str], root: Any = None) -> tuple[str, str | None]:
    """(message, hint) for a click/typer UsageError (``root``: the top command)."""
    ctx = getattr(exc, "ctx", None)
    where, command = _named_path(ctx, argv, root)
    help_hint = f"see '{where} --help'"
    name = type(exc).__name__
    if name == "NoSuchOption":
        opt = exc.option_name
        hint = _did_you_mean(opt, _option_names(command)) if command is not None else None
        return f"{where}: no such option {opt}", hint or help_hint
    message = str(getattr(exc, "message", "") or exc)
    if message.startswith("No such command"):
        typo = message.split("'")[1] if message.count("'") >= 2 else ""
        subs: list[str] = []
        if command is not None and hasattr(command, "list_commands"):
            subs = list(command.list_commands(ctx))
        hint = _did_you_mean(typo, subs) if typo else None
        return f"{where}: no such command '{typo}'", hint or (
            f"commands: {', '.join(subs)}" if subs else help_hint)
    if name == "MissingParameter":
        param = getattr(exc, "param", None)
        kind = getattr(param, "param_type_name", "parameter")
        label = _param_label(param, ctx)
        return f"{where}: missing {kind} {label}".rstrip(), help_hint
    if name == "BadParameter":
        param = getattr(exc, "param", None)
        got = _given_value(argv, param) if param is not None else None
        msg = exc.format_message()
        head, sep, tail = msg.partition(": ")
        msg = _lower_first(head) + sep + _lower_first(tail)
        if got is not None and repr(got) not in msg:
            msg += f" (got {got!r})"
        return f"{where}: {msg}", help_hint
    return f"{where}: {_lower_first(exc.format_message()).rstrip('.')}", help_hint


def _param_label(param: Any, ctx: Any) -> str:
    """``SRC`` for an argument, ``--to`` for an option."""
    if param is None:
        return ""
    if getattr(param, "param_type_name", "") == "option":
        return "/".join(param.opts)
    meta = getattr(param, "metavar", None)
    return str(meta or param.name or "").upper()


def validation_error(exc: Any) -> tuple[str, str | None]:
    """(message, hint) for a pydantic ValidationError that escaped a command."""
    first = exc.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or exc.title
    value = first.get("input")
    shown = f" (got {value!r})" if isinstance(value, (int, float, str, bool)) else ""
    msg = str(first["msg"]).removeprefix("Value error, ")
    return f"invalid value for '{field}': {msg[:1].lower()}{msg[1:]}{shown}", None


def report(exc: BaseException, argv: Sequence[str], root: Any = None) -> int:
    """Print ``exc`` as one line on stderr and return the exit code (``root``: the top
    click command, to name the sub-command in usage errors)."""
    from pydantic import ValidationError

    if isinstance(exc, ConvergentError):
        line, code = error_line(exc.message, exc.hint), exc.exit_code
    elif isinstance(exc, USAGE_ERRORS):
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare group: show its help
            exc.show()
            return 2
        line, code = error_line(*usage_error(exc, argv, root)), 2
    elif isinstance(exc, ValidationError):
        line, code = error_line(*validation_error(exc)), 2
    elif isinstance(exc, CLICK_ERRORS):
        line, code = error_line(exc.format_message()), getattr(exc, "exit_code", 1) or 1
    elif isinstance(exc, OSError) and getattr(exc, "filename", None):
        # an environment problem (permission, disk full, missing file): the user's to fix
        line = error_line(f"{exc.filename}: {exc.strerror or exc}")
        code = 2
    else:
        line = error_line(f"internal error: {type(exc).__name__}: {exc}",
                          "run again with --debug for the traceback, and please report it")
        code = 1
    print(line, file=sys.stderr, flush=True)
    return code
