"""Fixtures for the training-engine tests: a small EMT dataset and a run helper."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.moldataset import make_dataset


@pytest.fixture(scope="session")
def moldata(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(train, val) dataset directories: 96 + 24 rattled small molecules, EMT labels."""
    return make_dataset(tmp_path_factory.mktemp("moldata"))
