"""``runs rm``: delete a run directory, only ever a real one (it has a config.yaml)."""

from __future__ import annotations

import shutil

from convergent.core.errors import RunDirError
from convergent.runsdb.index import is_run
from convergent.runsdb.rundir import RunDir


def remove_run(run: RunDir) -> None:
    """Remove ``run``'s directory tree; refuses anything that is not a run directory.

    The directory is first renamed to a hidden sibling, so an interrupted removal never
    leaves something that still looks like a (half) run.
    """
    if not is_run(run.path) or run.path.is_symlink():
        raise RunDirError(f"{run.path} is not a run directory (no config.yaml); not removed")
    doomed = run.path.with_name(f".{run.path.name}.removing")
    if doomed.exists():
        shutil.rmtree(doomed)
    run.path.rename(doomed)
    shutil.rmtree(doomed)
