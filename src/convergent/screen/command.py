"""``convergent screen`` below the CLI: predict, select the uncertain, write the output.

:func:`screen_command` resolves the models, dataset and output directory from the
options and the ``screen`` config, predicts with the ensemble, and writes
``predictions.jsonl``, the selection (ensembles only) and ``summary.json``; a failed
screen leaves no half-written output directory.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from convergent.cluster.resources import set_torch_threads, usable_cpus
from convergent.config import ConvergentConfig
from convergent.core.errors import ConfigError
from convergent.core.fsutil import atomic_write_text, dumps_json
from convergent.screen.config import ScreenConfig
from convergent.screen.predict import predict_dataset
from convergent.screen.select import fetch_records, select_uncertain, write_selection

# why a summary number is null (strict JSON has no NaN; fsutil.dumps_json)
NULL_REASONS = {
    "energy_mae_eV": "no structure has a reference energy",
    "force_mae_eV_per_A": "no structure has reference forces",
    "mean_energy_std_eV": "one model: no ensemble spread",
    "mean_force_std_eV_per_A": "one model: no ensemble spread",
    "baseline_energy_mae_eV": "no labelled structure, or the model has no per-element "
                              "reference energies",
    "baseline_over_model": "no labelled structure, or the model has no per-element "
                           "reference energies",
}


def screen_command(
    cfg: ConvergentConfig, echo: Callable[[str], None], warn: Callable[[str], None],
    models: list[str] | None = None, data: str | None = None, out: Path | None = None,
    select: int | None = None, status: Any = None,
) -> dict[str, Any]:
    """Screen ``data`` (default ``screen.dataset``) with ``models`` (``screen.models``);
    returns the summary. ``status(text)`` is a context manager shown while predicting."""
    sc = cfg.screen
    models = list(models or sc.models)
    dataset = data or sc.dataset
    if not models:
        raise ConfigError("no model to screen with", hint="pass --model DIR or set screen.models")
    if not dataset:
        raise ConfigError("no dataset to screen", hint="pass --data PATH or set screen.dataset")
    out_dir = out or Path(sc.output or Path(cfg.run.root) / (cfg.run.name or "screen"))
    k = sc.select if select is None else select
    set_torch_threads(usable_cpus())
    if status is not None:
        with status(f"predicting {dataset} with {len(models)} model(s)"):
            result = predict_dataset(models, dataset, sc.batch_atoms, sc.device, quantize=sc.quantize)
    else:
        result = predict_dataset(models, dataset, sc.batch_atoms, sc.device, quantize=sc.quantize)
    created = not out_dir.exists()
    try:
        summary = write_screen(result, models, dataset, out_dir, k, sc, warn)
    except BaseException:
        if created:  # a failed screen leaves no half-written output directory
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    for key, val in summary.items():
        echo(f"{key}: {val}")
    echo(baseline_line(summary))
    echo(f"wrote {out_dir}")
    return summary


def write_screen(result: Any, models: list[str], dataset: str, out_dir: Path, k: int,
                 sc: ScreenConfig, warn: Callable[[str], None]) -> dict[str, Any]:
    """Write predictions, the selection (ensembles) and summary.json into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result.save_jsonl(out_dir / "predictions.jsonl")
    summary = result.summary()
    if len(models) > 1 and k > 0:
        picked = select_uncertain(result, k, sc.select_by, sc.max_per_molecule)
        chosen = fetch_records(dataset, [int(result.indices[i]) for i in picked])
        write_selection(result, picked, chosen, out_dir, sc.select_by)
        summary["selected"] = len(picked)
    else:
        summary["selected"] = 0
        if k > 0:
            warn("one model: no uncertainty, nothing selected (pass several --model for an "
                 "ensemble)")
    atomic_write_text(out_dir / "summary.json", dumps_json(summary, NULL_REASONS, indent=2))
    return summary


def baseline_line(summary: dict[str, Any]) -> str:
    """One line: the model's energy MAE beside the per-element baseline's, and their ratio."""
    model, base = summary.get("energy_mae_eV"), summary.get("baseline_energy_mae_eV")
    ratio = summary.get("baseline_over_model")
    if not _finite(model) or not _finite(base):
        return f"energy MAE vs per-element baseline: n/a ({NULL_REASONS['baseline_energy_mae_eV']})"
    verdict = (f"{ratio:.2f}x better than the baseline" if ratio >= 1 else
               f"{1 / ratio:.2f}x WORSE than the baseline: it has not learned beyond composition")
    return (f"energy MAE: model {model:.4g} eV, per-element baseline {base:.4g} eV "
            f"(fitted on the model's training data); the model is {verdict}")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and x == x and abs(x) != float("inf")
