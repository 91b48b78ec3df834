"""What a campaign checks before any work (``convergent learn``'s pre-flight, run by
``open_run`` before the run directory is created)."""

from __future__ import annotations

from pathlib import Path

from convergent.config import ConvergentConfig
from convergent.core.errors import InputError
from convergent.data.manifest import check_dataset
from convergent.learn.config import LearnConfig
from convergent.sim.sources import check_source


def check_inputs(cfg: ConvergentConfig) -> None:
    """What can fail before any work: the pool source, the warm-start model and dataset."""
    L: LearnConfig = cfg.learn
    check_source(cfg.simulate.source, "quarantine")
    init_model = L.members.init_model
    if init_model and not (Path(init_model) / "model_config.json").is_file():
        raise InputError(f"learn.members.init_model: {init_model} is not a saved model directory")
    if L.label.init_dataset:
        check_dataset(L.label.init_dataset, "learn.label.init_dataset")
