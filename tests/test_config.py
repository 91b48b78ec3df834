"""Config loading, --set overrides and their one-line errors."""

from __future__ import annotations

import pytest
import yaml

from convergent.config import ConvergentConfig, dump_config, load_config, parse_overrides
from convergent.errors import ConfigError


def test_defaults_are_valid_and_round_trip_through_yaml(tmp_path):
    cfg = ConvergentConfig()
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


def test_yaml_values_then_overrides_win(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"lr": 0.01, "steps": 7}}))
    cfg = load_config(path, ["train.lr=3e-4", "simulate.temperatures=[300, 600]"])
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.train.steps == 7
    assert cfg.simulate.temperatures == [300.0, 600.0]


def test_bad_override_value_names_the_key():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.lr=abc"])
    assert "train.lr" in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_override_key_names_it_and_lists_choices():
    with pytest.raises(ConfigError) as err:
        parse_overrides(["train.lrr=1"])
    assert "train.lrr" in str(err.value)
    assert "lr" in (err.value.hint or "")


def test_override_into_a_non_section_is_an_error():
    with pytest.raises(ConfigError, match="train.lr.x"):
        parse_overrides(["train.lr.x=1"])


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["train.lr"])


def test_unknown_key_in_yaml_names_file_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  learning_rate: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "bad.yaml" in str(err.value) and "train.learning_rate" in str(err.value)


def test_missing_and_malformed_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "broken.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="broken.yaml"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listy)


def test_example_configs_are_valid():
    from pathlib import Path

    examples = sorted(Path(__file__).resolve().parents[1].joinpath("examples").glob("*.yaml"))
    assert examples, "examples/ should hold at least demo.yaml"
    for path in examples:
        load_config(path)
