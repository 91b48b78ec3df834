"""The user-facing error type.

A :class:`ConvergentError` is a user's mistake or an environment problem (bad config,
missing file, malformed structure, corrupted shard). The CLI prints it as one line
``error: <message>`` plus an optional ``hint: <hint>`` line and exits with code 2, no
traceback (``--debug`` shows it). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class ConvergentError(Exception):
    """A user-facing error: one clear line naming the file or field, and a hint."""

    exit_code: int = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class ConfigError(ConvergentError):
    """Bad configuration: unknown key, wrong type, missing or unreadable config file."""


class RunDirError(ConvergentError):
    """The run directory cannot be used as asked (exists, locked, incomplete)."""


class DataError(ConvergentError):
    """A dataset is malformed, corrupted or incompatible (names the shard and offset)."""


class InputError(ConvergentError):
    """A user-supplied structure/SMILES/file is malformed (names the file and line)."""


class NotAvailableError(ConvergentError):
    """A feature needs hardware or a package that this machine does not have."""


def parse_location(exc: BaseException) -> tuple[int | None, str]:
    """(1-based line or None, problem) of a YAML or JSON parse error, for messages
    of the form ``FILE:LINE: not valid JSON (problem)``."""
    mark = getattr(exc, "problem_mark", None)  # yaml.MarkedYAMLError
    if mark is not None:
        return mark.line + 1, str(getattr(exc, "problem", None) or exc)
    lineno = getattr(exc, "lineno", None)  # json.JSONDecodeError
    if isinstance(lineno, int) and hasattr(exc, "msg"):
        return lineno, str(exc.msg)
    return None, " ".join(str(exc).split()) or type(exc).__name__


def parse_error_text(path: object, kind: str, exc: BaseException) -> str:
    """``FILE:LINE: not valid KIND (problem)`` (``FILE: ...`` when the line is unknown)."""
    line, problem = parse_location(exc)
    return f"{path}{f':{line}' if line else ''}: not valid {kind} ({problem})"
