"""Where the ``convergent`` console script is, for tests that run it as a real subprocess.

On ``PATH`` first: the virtualenv's ``bin`` when it is active, or the shim that
``make test-gpu`` puts there on a GPU machine whose image has no console script. Else the
script beside this interpreter (a venv run by its full path, as ``make test`` does)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

_BESIDE = Path(sys.executable).parent / "convergent"
EXE = str(_BESIDE) if _BESIDE.exists() else (shutil.which("convergent") or str(_BESIDE))
