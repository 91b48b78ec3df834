"""The suite's root conftest: how the tests are grouped when pytest-xdist spreads them.

`make test` runs the suite over a few workers with ``--dist loadgroup``: each folder of
tests/ is one group (its session fixtures — the two-node Slurm cluster, the demo runs of
tests/runs — are built once, on one worker, and two Slurm clusters never start side by
side), and each file at the root is a group of its own. Without xdist the marks do nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(_TESTS)
        group = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        item.add_marker(pytest.mark.xdist_group(group))
