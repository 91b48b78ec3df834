"""The demo's own defaults: under the YAML file and --set, never over them."""

from __future__ import annotations

from convergent.config import ConvergentConfig, load_config
from convergent.demo import DEMO_PRESET


def test_demo_preset_sits_between_defaults_and_user_settings(tmp_path):
    plain = ConvergentConfig()
    demo = load_config(None, None, DEMO_PRESET)
    assert demo.train.force_weight == DEMO_PRESET["train"]["force_weight"] != plain.train.force_weight
    assert demo.train.steps == DEMO_PRESET["train"]["steps"] != plain.train.steps
    assert demo.train.lr == plain.train.lr  # what the preset leaves alone is the default
    yml = tmp_path / "c.yaml"
    yml.write_text("train:\n  steps: 7\n")
    from_file = load_config(yml, None, DEMO_PRESET)
    assert from_file.train.steps == 7  # the file wins over the preset ...
    assert from_file.train.force_weight == DEMO_PRESET["train"]["force_weight"]  # ... key by key
    assert load_config(yml, ["train.force_weight=3"], DEMO_PRESET).train.force_weight == 3.0
    assert load_config(None, None).train.force_weight == plain.train.force_weight  # other commands
