"""Where an active-learning campaign keeps its state inside a run directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from convergent.runsdb.rundir import RunDir


@dataclass(frozen=True)
class Paths:
    """Where a campaign keeps its state inside a run directory."""

    run: RunDir

    @property
    def root(self) -> Path:
        return self.run.path / "learn"

    @property
    def labels(self) -> Path:
        return self.run.data / "labels"

    @property
    def holdout(self) -> Path:
        return self.run.data / "holdout"

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    @property
    def timeline(self) -> Path:
        return self.root / "timeline.jsonl"

    @property
    def rounds(self) -> Path:
        return self.root / "rounds.jsonl"

    def member(self, rnd: int, k: int) -> Path:
        return self.run.ckpt / f"round-{rnd:03d}" / f"m{k}"

    def selection(self, rnd: int) -> Path:
        return self.root / f"selection-r{rnd:03d}.json"

    def md(self, rnd: int) -> Path:
        return self.root / f"md-r{rnd:03d}.npz"
