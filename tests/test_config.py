"""Config loading, --set overrides and their one-line errors."""

from __future__ import annotations

import pytest
import yaml

from convergent.config import ConvergentConfig, dump_config, load_config, parse_overrides
from convergent.core.errors import ConfigError


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


def _numeric_fields(model=ConvergentConfig, prefix=""):
    """Dotted names of every int/float field (also inside ``X | None``) of every section."""
    import typing

    from convergent.core.configbase import Section

    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, Section):
            yield from _numeric_fields(ann, f"{prefix}{name}.")
            continue
        args = typing.get_args(ann) if typing.get_origin(ann) in (typing.Union, __import__("types").UnionType) else (ann,)
        bases = {typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a for a in args}
        if bases & {int, float} and bool not in bases:
            yield f"{prefix}{name}"


# Numeric fields where a negative value is meaningful (none today). A new count, size,
# rate, seed or port belongs in configbase's bounded types instead of this list.
SIGNED: set[str] = set()
NUMERIC = sorted(set(_numeric_fields()) - SIGNED)


def test_the_bound_walk_sees_every_section():
    assert {"train.steps", "data.shard_bytes", "serve.http.port", "simulate.relabel.max_cycle",
            "cluster.slurm.cores", "metrics.log_every", "model.hidden"} <= set(NUMERIC)


@pytest.mark.parametrize("field", NUMERIC)
def test_every_count_size_and_rate_is_bounded(field):
    """-1 is wrong for every count, size, rate, seed and port: refused at load, named."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{field}=-1"])
    assert f"'{field}'" in err.value.message and "\n" not in err.value.message


@pytest.mark.parametrize("override, needle", [
    ("train.steps=0", "greater than or equal to 1"),
    ("train.lr=nan", "finite"),
    ("model.heads=5", "must divide model.hidden"),
    ("simulate.min_atoms=50", "simulate.max_atoms"),
    ("run.name=a/b", "single name"),
    ("parallel.rdzv_endpoint=host", "host:port"),
    ("cluster.slurm.walltime=2h", "Slurm time"),
    ("cluster.slurm.memory=lots", "pattern"),
    ("serve.http.port=70000", "less than or equal to 65535"),
    ("data.val_fraction=1", "less than 1"),
])
def test_cross_field_and_format_bounds(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert needle in err.value.message and override.split("=")[0] in err.value.message


def test_unknown_keys_get_a_did_you_mean(tmp_path):
    with pytest.raises(ConfigError) as err:
        parse_overrides(["train.stpes=3"])
    assert err.value.hint == "did you mean train.steps?"
    path = tmp_path / "c.yaml"
    path.write_text("run:\n  name: x\nmodel:\n  hidden: 32\n  hiddn: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.message == f"{path}:5: unknown config key 'model.hiddn'"
    assert err.value.hint == "did you mean model.hidden?"


def test_yaml_validation_errors_name_the_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("# demo\ntrain:\n  lr: 1e-3\n  steps: -5\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.message.startswith(f"{path}:4: invalid value for 'train.steps'")
    path.write_text("train:\n  steps: 3\n lr: [1\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:3: not valid YAML \(expected"):
        load_config(path)


def test_json_and_yaml_side_files_name_their_line(tmp_path):
    from convergent.core.errors import InputError
    from convergent.models.llama import read_config
    from convergent.train.topology import read_topology_file

    topo = tmp_path / "topo.yaml"
    topo.write_text("racks:\n  r1: [a, b\n  r2: [c]\n")
    with pytest.raises(ConfigError, match=r"topo\.yaml:3: not valid YAML"):
        read_topology_file(topo)
    hf = tmp_path / "config.json"
    hf.write_text('{\n  "hidden_size": 8,\n}\n')
    with pytest.raises(InputError, match=r"config\.json:3: not valid JSON \(Expecting property name"):
        read_config(hf)


def test_a_moved_learn_key_names_its_new_place(tmp_path):
    """learn's flat keys moved into sub-sections or to the section they repeated: each is
    refused in one line naming the new key (YAML with its line, and --set)."""
    from convergent.learn.config import MOVED_KEYS

    assert MOVED_KEYS["learn.lr"] == "train.lr" and MOVED_KEYS["learn.pool"] == "simulate.source"
    p = tmp_path / "old.yaml"
    p.write_text("learn:\n  rounds: 2\n  lr: 0.001\n")
    with pytest.raises(ConfigError, match=r"old.yaml:3: config key 'learn.lr' has moved to 'train.lr'"):
        load_config(p)
    for old, new in [("learn.pool=nci", "simulate.source"), ("learn.committee.size=2", None),
                     ("learn.md_steps=10", "learn.explore.steps")]:
        if new is None:  # not a moved key: committee stays a count
            with pytest.raises(ConfigError, match="is not a section"):
                load_config(None, [old])
            continue
        with pytest.raises(ConfigError, match=f"--set: config key '{old.split('=')[0]}' has moved to '{new}'"):
            load_config(None, [old])
    # the new layout, where a moved key's name is now a section's: accepted
    p.write_text("learn:\n  pool:\n    conformers: 3\n")
    assert load_config(p).learn.pool.conformers == 3
    assert load_config(None, ["learn.pool.sample=5"]).learn.pool.sample == 5
    # every new place exists
    for new in MOVED_KEYS.values():
        section, *rest = new.split(".")
        node = getattr(ConvergentConfig(), section)
        for key in rest:
            node = getattr(node, key)


def test_learn_cli_refuses_a_moved_key_in_one_line(tmp_path):
    from convergent.cli import main

    code = main(["learn", "--run-dir", str(tmp_path / "r"), "--set", "learn.train_steps=5"])
    assert code == 2 and not (tmp_path / "r").exists()


def test_a_moved_serve_key_names_its_new_place(tmp_path):
    """serve's flat keys moved into its sub-sections (engine, scheduler, http, faults,
    dispatch); each is refused in one line naming the new key (YAML with its line, and
    --set). ``serve.scheduler`` was the policy's name and is now a section: a scalar there
    names ``serve.scheduler.kind``, a mapping is the new layout."""
    from convergent.serve.config import MOVED_KEYS

    assert MOVED_KEYS["serve.port"] == "serve.http.port"
    assert MOVED_KEYS["serve.dispatch_policy"] == "serve.dispatch.policy"
    p = tmp_path / "old.yaml"
    p.write_text("serve:\n  model: m\n  scheduler: sequential\n")
    with pytest.raises(ConfigError, match=r"old.yaml:3: config key 'serve.scheduler' has moved "
                       r"to 'serve.scheduler.kind'") as e:
        load_config(p)
    assert "docs/serving.md" in e.value.hint
    for old, new in [("serve.scheduler=tdpipe", "serve.scheduler.kind"),
                     ("serve.kv_budget_bytes=4096", "serve.engine.kv_budget_bytes"),
                     ("serve.max_restarts=1", "serve.faults.max_restarts"),
                     ("serve.dispatch_max_outstanding=4", "serve.dispatch.max_outstanding")]:
        with pytest.raises(ConfigError, match=f"--set: config key '{old.split('=')[0]}' has moved to '{new}'"):
            load_config(None, [old])
    # the new layout: accepted
    p.write_text("serve:\n  scheduler:\n    kind: sequential\n  http:\n    port: 8123\n")
    cfg = load_config(p, ["serve.scheduler.stages=1", "serve.dispatch.policy=round_robin"])
    assert (cfg.serve.scheduler.kind, cfg.serve.scheduler.stages) == ("sequential", 1)
    assert cfg.serve.http.port == 8123 and cfg.serve.dispatch.policy == "round_robin"
    # every field of every sub-section is where exactly one flat key went
    serve = ConvergentConfig().serve
    leaves = {f"serve.{sec}.{f}" for sec, info in type(serve).model_fields.items()
              if sec != "model" for f in type(getattr(serve, sec)).model_fields}
    assert sorted(MOVED_KEYS.values()) == sorted(leaves)


def test_serve_cli_refuses_a_moved_key_in_one_line(capsys):
    from convergent.cli import main

    code = main(["serve", "--set", "serve.instances=2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "'serve.instances' has moved to 'serve.dispatch.instances'" in err
