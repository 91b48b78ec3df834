"""The code version that produced a record: git commit and a dirty flag.

:func:`code_version` asks git about the checkout that holds this package (once per
process, cached). Outside a git checkout (an installed wheel, no ``git`` binary) it
returns ``commit="unknown"`` and ``dirty=None`` instead of failing. Runs, checkpoints
and bench results store :meth:`CodeVersion.to_dict` under ``"code"``.
"""

from __future__ import annotations

import functools
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from convergent import __version__

UNKNOWN = "unknown"


@dataclass(frozen=True)
class CodeVersion:
    """``commit``: full hash or ``"unknown"``; ``dirty``: tracked files differ from it."""

    commit: str
    dirty: bool | None
    version: str = __version__

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def short(self) -> str:
        """``abc1234`` / ``abc1234+dirty`` / ``unknown`` for one-line displays."""
        if self.commit == UNKNOWN:
            return UNKNOWN
        return self.commit[:7] + ("+dirty" if self.dirty else "")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> CodeVersion:
        data = data or {}
        return cls(str(data.get("commit", UNKNOWN)), data.get("dirty"),
                   str(data.get("version", UNKNOWN)))


def _git(where: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_version(where: str | Path) -> CodeVersion:
    """The commit and dirty flag of the git checkout containing ``where`` (uncached)."""
    where = Path(where)
    commit = _git(where, "rev-parse", "--verify", "HEAD")
    if not commit:
        return CodeVersion(UNKNOWN, None)
    status = _git(where, "status", "--porcelain", "--untracked-files=no")
    return CodeVersion(commit, None if status is None else bool(status))


@functools.lru_cache(maxsize=1)
def code_version() -> CodeVersion:
    """The version of the code of this package (cached: git runs once per process)."""
    return git_version(Path(__file__).resolve().parent)
