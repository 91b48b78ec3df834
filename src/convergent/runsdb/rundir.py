"""Run directories: ``runs/<name>/{config.yaml, metrics.jsonl, logs/, ckpt/, data/, report/}``.

Starting into an existing run either resumes it (``resume=True``) or refuses with a clear
message; nothing is ever silently overwritten. Stages record completion in
``stages.json`` so a resumed run skips what is done.

A start is validated before anything is created (``open_run(..., check=...)`` runs the
stage's input checks first), and a run directory whose start failed before it produced
anything (no finished stage, no metric, no file under ``ckpt/``, ``data/``, ``report/``;
logs do not count) is started again by the same or a corrected command, so a fixed retry
is never refused with "already exists" or "different config". While a process uses a run
it holds an advisory lock on ``<run>/.lock`` (released when it exits, even by a crash),
so a second process is refused instead of restarting or resuming the same run.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convergent.config import ConvergentConfig, dump_config, save_config
from convergent.core.errors import RunDirError
from convergent.core.fsutil import atomic_write_text, dumps_json, read_jsonl


@dataclass(frozen=True)
class RunDir:
    """Paths of one run. Create with :func:`open_run`."""

    path: Path

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def ckpt(self) -> Path:
        return self.path / "ckpt"

    @property
    def data(self) -> Path:
        return self.path / "data"

    @property
    def report(self) -> Path:
        return self.path / "report"

    @property
    def stages_file(self) -> Path:
        return self.path / "stages.json"

    def stages(self) -> dict[str, Any]:
        """Completed stages: name -> summary dict written by :meth:`mark_done`."""
        if not self.stages_file.exists():
            return {}
        return json.loads(self.stages_file.read_text())

    def has_results(self) -> bool:
        """True once the run holds something worth keeping: a finished stage, a metric
        record, or any file under ``ckpt/``, ``data/`` or ``report/`` (logs do not count)."""
        if self.stages_file.exists() and self.stages_file.stat().st_size > 2:
            return True
        if self.metrics.exists() and self.metrics.stat().st_size > 0:
            return True
        for sub in (self.ckpt, self.data, self.report):
            if sub.is_dir() and any(p.is_file() for p in sub.rglob("*")):
                return True
        return False

    def is_done(self, stage: str) -> bool:
        return stage in self.stages()

    def mark_done(self, stage: str, summary: dict[str, Any]) -> None:
        """Record that ``stage`` finished, with its summary (seconds, counts, ...)."""
        from convergent.core.provenance import code_version

        stages = self.stages()
        stages[stage] = {"finished_at": time.time(), "code": code_version().to_dict(), **summary}
        atomic_write_text(self.stages_file, dumps_json(stages, indent=2))

    def log_metrics(self, record: dict[str, Any]) -> None:
        """Append one JSON line to metrics.jsonl (adds ``time`` if missing)."""
        record = {"time": time.time(), **record}
        with self.metrics.open("a", encoding="utf-8") as fh:
            fh.write(dumps_json(record) + "\n")

    def read_metrics(self, kind: str | None = None) -> list[dict[str, Any]]:
        """All metric records, optionally only those with ``record['kind'] == kind``."""
        return [row for row in read_jsonl(self.metrics) if kind is None or row.get("kind") == kind]


LOCK_NAME = ".lock"
_held: dict[Path, int] = {}  # run directories this process has locked (fd kept open)


def lock_run(path: Path) -> None:
    """Hold the advisory lock of run ``path`` for this process's lifetime.

    RunDirError if another process holds it. Filesystems without ``flock`` are not
    locked (no error)."""
    key = path.resolve()
    if key in _held:
        return
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RunDirError(
                f"run directory {path} is in use by another process" + (f" (pid {owner})" if owner else ""),
                hint="wait for it to finish, or choose another --run-dir",
            ) from None
        return  # no locking on this filesystem
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[key] = fd


def run_path(cfg: ConvergentConfig, run_dir: str | Path | None, command: str) -> Path:
    """``run_dir`` if given, else ``<run.root>/<run.name>`` with the command's name as default."""
    if run_dir is not None:
        return Path(run_dir)
    return Path(cfg.run.root) / (cfg.run.name or command)


def open_run(
    cfg: ConvergentConfig, run_dir: str | Path | None = None, resume: bool = False,
    command: str = "run", check: Callable[[], None] | None = None,
) -> RunDir:
    """Create a new run directory, or resume an existing one.

    Without ``run_dir`` the directory is ``<run.root>/<run.name or command>``.
    An existing directory with results is resumed only when ``resume`` is true and its
    config equals ``cfg`` (else :class:`RunDirError`); a non-empty directory without a
    config is refused. An existing run without results (a start that failed) is started
    again with ``cfg``. ``check`` (the stage's input validation) runs after these checks
    and before anything is created, so a failed check leaves nothing behind.
    """
    path = run_path(cfg, run_dir, command)
    run = RunDir(path)
    restart = False
    if path.exists() and not path.is_dir():
        raise RunDirError(f"{path} exists and is not a directory", hint="choose another --run-dir")
    if path.exists() and any(p.name != LOCK_NAME for p in path.iterdir()):
        if not run.config.exists():
            raise RunDirError(
                f"{path} exists and is not a convergent run directory",
                hint="choose another --run-dir",
            )
        lock_run(path)  # another process using this run is refused, never restarted
        if not run.has_results():
            restart = True  # an earlier start failed before producing anything
        elif not resume:
            raise RunDirError(
                f"run directory {path} already exists",
                hint="pass --resume to continue it, or choose another --run-dir / --name",
            )
        elif run.config.read_text(encoding="utf-8") != dump_config(cfg):
            raise RunDirError(
                f"{path}: cannot resume with a different config than {run.config}",
                hint="resume without --set changes, or start a new run",
            )
    if check is not None:
        check()
    for sub in (run.logs, run.ckpt, run.data, run.report):
        sub.mkdir(parents=True, exist_ok=True)
    lock_run(path)
    if restart or not run.config.exists():
        save_config(cfg, run.config)
    return run
