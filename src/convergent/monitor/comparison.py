"""The run's trained models side by side: ours and each peer (``demo.peers``, e.g. MACE).

:class:`ModelResult` is the typed record of one trained model on the held-out molecules:
the demo's ``peer_<kind>`` stage writes one (``stages.json`` and a ``model_result`` line of
``metrics.jsonl``) and the report reads it back with :meth:`ModelResult.from_dict`. Ours
is the run's own train, screen and md_check stages (:func:`ours_result`, the one reader of
their keys). Energies in eV, forces in eV/Å, times in seconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from convergent.monitor.reportkit import fmt
from convergent.runsdb.usage import PEER_PREFIX


def peer_stage(kind: str) -> str:
    """The ``stages.json`` name of the peer stage of model kind ``kind``."""
    return f"{PEER_PREFIX}{kind}"


@dataclass
class ModelResult:
    """One trained model: held-out accuracy against the per-element baseline, the MD
    check, its size and its training time."""

    KIND: ClassVar[str] = "model_result"  # the metrics.jsonl record kind

    name: str  # "ours", or the peer's model kind
    model_kind: str  # model.kind it was trained as
    structures: int  # held-out structures screened
    energy_mae: float | None  # eV per structure
    energy_mae_per_atom: float | None  # eV/atom
    baseline_energy_mae: float | None  # the per-element baseline's, eV per structure
    baseline_over_model: float | None  # > 1: the model beats the baseline by that factor
    force_mae: float | None  # eV/Å
    stable_runs: int | None  # MD check runs that stayed bonded
    total_runs: int | None
    params: int | None  # trainable and frozen parameters of the exported model
    steps: int | None  # optimizer steps trained
    train_s: float | None  # wall seconds of the training job
    model_dir: str | None = None  # the exported model

    @property
    def stable_fraction(self) -> float | None:
        if self.stable_runs is None or not self.total_runs:
            return None
        return self.stable_runs / self.total_runs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_metric(self) -> dict[str, Any]:
        """The ``metrics.jsonl`` line: ``{"kind": "model_result", ...}``."""
        return {"kind": self.KIND, **self.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelResult:
        """From :meth:`to_dict` (or a stage summary holding it: other keys are ignored)."""
        return cls(**{f.name: d.get(f.name) for f in fields(cls)})


def _num(d: dict[str, Any], key: str) -> Any:
    v = d.get(key)
    return v if isinstance(v, int | float) and not isinstance(v, bool) else None


def ours_result(stages: dict[str, Any]) -> ModelResult | None:
    """Ours from the demo's train, screen and md_check stage summaries (None before the
    screen stage has run)."""
    screen = stages.get("screen")
    if not screen:
        return None
    train, mdc = stages.get("train") or {}, stages.get("md_check") or {}
    train_s = _num(train, "train_s")
    return ModelResult(
        name="ours", model_kind=str(screen.get("model_kind") or "molecular"),
        structures=int(screen.get("structures") or 0), energy_mae=_num(screen, "energy_mae"),
        energy_mae_per_atom=_num(screen, "energy_mae_per_atom"),
        baseline_energy_mae=_num(screen, "baseline_energy_mae"),
        baseline_over_model=_num(screen, "baseline_over_model"), force_mae=_num(screen, "force_mae"),
        stable_runs=_num(mdc, "stable_runs"), total_runs=_num(mdc, "total_runs"),
        params=_num(screen, "params"), steps=_num(train, "steps"),
        train_s=train_s if train_s is not None else _num(train, "wall_s"),
        model_dir=screen.get("model_dir"))


def peer_results(stages: dict[str, Any]) -> list[ModelResult]:
    """Every finished peer stage of the run, in the order they ran."""
    return [ModelResult.from_dict(v) for k, v in stages.items()
            if k.startswith(PEER_PREFIX) and isinstance(v, dict)]


def model_results(stages: dict[str, Any]) -> list[ModelResult]:
    """Ours and the peers, or ``[]`` when no peer was trained (the report is then as
    without peers)."""
    peers = peer_results(stages)
    ours = ours_result(stages)
    return [ours, *peers] if peers and ours is not None else peers


def _ratio(x: float | None) -> str:
    return f"{x:.2f}x" if x is not None else "n/a"


def _md(r: ModelResult) -> str:
    if r.stable_runs is None or r.total_runs is None:
        return "n/a"
    return f"{r.stable_runs} / {r.total_runs}"


def _label(r: ModelResult) -> str:
    return r.name if r.name == r.model_kind else f"{r.name} ({r.model_kind})"


def _cells(r: ModelResult) -> list[str]:
    mev = fmt(r.energy_mae_per_atom * 1e3, ".1f") if r.energy_mae_per_atom is not None else "n/a"
    return [_label(r), fmt(r.energy_mae) if r.energy_mae is not None else "n/a", mev,
            fmt(r.force_mae) if r.force_mae is not None else "n/a", _ratio(r.baseline_over_model),
            _md(r), f"{r.params:,}" if r.params is not None else "n/a",
            str(r.steps) if r.steps is not None else "n/a",
            fmt(r.train_s, ".0f") if r.train_s is not None else "n/a"]


HEADER = ["model", "energy MAE (eV)", "(meV/atom)", "force MAE (eV/Å)", "baseline / model",
          "MD check stable", "parameters", "steps", "training time (s)"]


def comparison_section(rows: list[ModelResult]) -> list[str]:
    """The report's "Models side by side" section (nothing for fewer than two models)."""
    if len(rows) < 2:
        return []
    n = rows[0].structures
    return ["## Models side by side (held-out molecules)",
            f"Each model trained on the same split with the same training settings, screened on "
            f"the same {n} held-out structures against the same per-element baseline, and run "
            "through the same MD check (`demo.peers` adds models).", "",
            "| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER),
            *["| " + " | ".join(_cells(r)) + " |" for r in rows], ""]


def console_lines(rows: list[ModelResult]) -> list[str]:
    """The demo's console summary of the same table, one line per model."""
    cells = [HEADER, *[_cells(r) for r in rows]]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    return ["  ".join(c[i].ljust(widths[i]) for i in range(len(HEADER))).rstrip() for c in cells]
