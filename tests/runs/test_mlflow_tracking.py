"""MLflow tracking for real: the store's run rules, read back with MLflow's own client.
(What a demo run logged is checked in test_runs_cli.py, beside the other tests of the
session's two demo runs, so that one pytest-xdist worker builds them once.)"""

from __future__ import annotations

import pytest

mlflow = pytest.importorskip("mlflow", reason="the tracking extra (pip install convergent[tracking])")


def test_a_restart_with_another_config_gets_a_new_mlflow_run(tmp_path):
    from convergent.config import load_config
    from convergent.tracking.store import open_tracking

    first = open_tracking(load_config(None, ["tracking.mlflow=true", "train.lr=1e-3"]), tmp_path)
    again = open_tracking(load_config(None, ["tracking.mlflow=true", "train.lr=1e-3"]), tmp_path)
    assert again.run_id == first.run_id  # the same config resumes the same MLflow run
    other = open_tracking(load_config(None, ["tracking.mlflow=true", "train.lr=2e-3"]), tmp_path)
    assert other.run_id != first.run_id
    client = other.client
    assert client.get_run(first.run_id).info.status == "FAILED"
    assert client.get_run(other.run_id).data.params["train.lr"] == "0.002"


def test_an_unusable_store_is_one_error_naming_the_uri(tmp_path):
    from convergent.config import load_config
    from convergent.core.errors import NotAvailableError
    from convergent.tracking.store import open_tracking

    cfg = load_config(None, ["tracking.mlflow=true", "tracking.uri=foo://nowhere"])
    with pytest.raises(NotAvailableError, match="MLflow store foo://nowhere: "):
        open_tracking(cfg, tmp_path)
