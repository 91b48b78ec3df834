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
