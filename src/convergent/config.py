"""The whole configuration: one pydantic section per stage, YAML load, ``--set`` overrides.

Every field has a default that works on a 2-core laptop, so ``ConvergentConfig()`` is a
valid config. ``load_config(path, ["train.lr=3e-4"])`` reads YAML, applies overrides with
type validation and raises :class:`~convergent.core.errors.ConfigError` naming the bad key.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator

from convergent.analytics.config import AnalyticsConfig
from convergent.cluster.config import ClusterConfig
from convergent.core.configbase import Name, PathStr, Section
from convergent.core.errors import ConfigError, parse_error_text
from convergent.core.fsutil import atomic_write_text
from convergent.data.config import DataConfig, TextConfig
from convergent.learn.config import MOVED_KEYS as LEARN_MOVED_KEYS
from convergent.learn.config import LearnConfig
from convergent.models.config import ModelConfig
from convergent.monitor.config import MetricsConfig
from convergent.screen.config import ScreenConfig
from convergent.serve.config import MOVED_KEYS as SERVE_MOVED_KEYS
from convergent.serve.config import ServeConfig
from convergent.sim.config import SimulateConfig
from convergent.tracking.config import TrackingConfig
from convergent.train.config import CheckpointConfig, ParallelConfig, PrecisionConfig, TrainConfig


class RunConfig(Section):
    """Naming of the run directory ``<root>/<name>``."""

    name: Name | None = None  # None: the command's own name (demo, train, simulate, ...)
    root: PathStr = "runs"


class DemoConfig(Section):
    """What ``convergent demo`` trains beside ours. ``peers``: other model kinds trained on
    the same split with the same training settings, screened on the same held-out
    molecules and run through the same MD check; the report puts them side by side.
    ``mace``: mace-torch's MACE, sized by ``model.mace`` (the demo's preset makes it small;
    needs the ``mace`` extra). Empty by default: ``make demo`` trains ours only."""

    peers: list[Literal["mace"]] = Field(default_factory=list)

    @field_validator("peers")
    @classmethod
    def _each_once(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("names a model kind twice")
        return v


class ConvergentConfig(Section):
    """All sections; each stage reads only its own."""

    run: RunConfig = RunConfig()
    cluster: ClusterConfig = ClusterConfig()
    simulate: SimulateConfig = SimulateConfig()
    data: DataConfig = DataConfig()
    analytics: AnalyticsConfig = AnalyticsConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()
    precision: PrecisionConfig = PrecisionConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()
    tracking: TrackingConfig = TrackingConfig()
    screen: ScreenConfig = ScreenConfig()
    serve: ServeConfig = ServeConfig()
    learn: LearnConfig = LearnConfig()
    text: TextConfig = TextConfig()  # the LM task's text corpus (convergent.data.textcorpus)
    demo: DemoConfig = DemoConfig()  # what `convergent demo` trains beside ours


# Keys of earlier layouts and where each went: a config that uses one is refused in one
# line naming the new key (each section module that moved keys lists them).
MOVED_KEYS: dict[str, str] = {**LEARN_MOVED_KEYS, **SERVE_MOVED_KEYS}
MOVED_DOCS = {"learn": "docs/science.md, the learn section",
              "serve": "docs/serving.md, the serve section"}


def _moved_error(dotted: str, where: str) -> ConfigError:
    new, doc = MOVED_KEYS[dotted], MOVED_DOCS[dotted.split(".")[0]]
    return ConfigError(f"{where}: config key '{dotted}' has moved to '{new}'",
                       hint=f"write {new} instead ({doc})")


def _check_moved(data: dict[str, Any], source: str, path: str | Path | None = None) -> None:
    """Refuse a key of an earlier layout present in ``data`` (a YAML file's tree). A moved
    key whose name is now a section's (``learn.pool``) counts only with a non-mapping value."""
    for dotted in MOVED_KEYS:
        keys = dotted.split(".")
        node: Any = data
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or keys[-1] not in node:
            continue
        if isinstance(node[keys[-1]], dict) and _section_at(keys) is not None:
            continue
        line = yaml_line(path, tuple(keys)) if path is not None else None
        raise _moved_error(dotted, f"{source}:{line}" if line else source)


def _parse_value(text: str) -> Any:
    """Parse an override value as YAML scalar/list (``3e-4``, ``true``, ``[1,2]``, ``abc``)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    # YAML 1.1 reads "3e-4" as a string; let pydantic coerce numeric strings itself.
    return text if value is None and text.strip() not in ("null", "~", "") else value


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``tree[a][b][c] = value`` for ``dotted == 'a.b.c'``, checking keys exist."""
    keys = dotted.split(".")
    node: dict[str, Any] = tree
    model: type[Section] | None = ConvergentConfig
    if dotted in MOVED_KEYS and not (isinstance(value, dict) and _section_at(keys) is not None):
        raise _moved_error(dotted, "--set")
    for depth, key in enumerate(keys):
        if model is not None and key not in model.model_fields:
            where = ".".join(keys[:depth]) or "top level"
            raise ConfigError(
                f"unknown config key '{dotted}' ('{key}' is not a field of {where})",
                hint=_key_hint(key, keys[:depth], model),
            )
        annotation = model.model_fields[key].annotation if model is not None else None
        is_section = isinstance(annotation, type) and issubclass(annotation, Section)
        if depth == len(keys) - 1:
            node[key] = value
            return
        if not is_section:
            raise ConfigError(f"config key '{dotted}': '{key}' is not a section")
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config key '{dotted}': '{key}' must be a mapping")
        model = annotation


def _key_hint(key: str, parents: list[str], model: type[Section] | None) -> str:
    """``did you mean train.steps?`` (difflib), else the valid keys of that section."""
    fields = sorted(model.model_fields) if model is not None else []
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
    if close:
        return "did you mean " + ".".join([*parents, close[0]]) + "?"
    return "valid keys here: " + ", ".join(fields)


def _section_at(loc: list[str]) -> type[Section] | None:
    """The Section class reached by following ``loc`` from the top (None if not a section)."""
    model: type[Section] = ConvergentConfig
    for key in loc:
        ann = model.model_fields[key].annotation if key in model.model_fields else None
        if not (isinstance(ann, type) and issubclass(ann, Section)):
            return None
        model = ann
    return model


def yaml_line(path: str | Path, loc: tuple[str | int, ...]) -> int | None:
    """1-based line of the key ``loc`` (e.g. ``('train', 'steps')``) in a YAML file."""
    try:
        node = yaml.compose(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            hit = next(((k, v) for k, v in node.value if k.value == str(part)), None)
            if hit is None:
                return line
            line, node = hit[0].start_mark.line + 1, hit[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _format_validation_error(exc: ValidationError, source: str,
                             path: str | Path | None = None) -> ConfigError:
    """Turn pydantic's multi-line report into one line naming the first bad field
    (and, for a YAML file, its line: ``demo.yaml:12``)."""
    first = exc.errors()[0]
    loc = tuple(first["loc"])
    field = ".".join(str(p) for p in loc)
    line = yaml_line(path, loc) if path is not None else None
    where = f"{source}:{line}" if line else source
    value = first.get("input")
    shown = f" (got {value!r})" if not isinstance(value, dict) else ""
    msg = first["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    msg = msg[:1].lower() + msg[1:]
    if first["type"] == "extra_forbidden":
        parents = [str(p) for p in loc[:-1]]
        return ConfigError(f"{where}: unknown config key '{field}'",
                           hint=_key_hint(str(loc[-1]), parents, _section_at(parents)))
    return ConfigError(f"{where}: invalid value for '{field}': {msg}{shown}")


def parse_overrides(overrides: list[str] | None) -> dict[str, Any]:
    """Turn ``["a.b=1", "c.d=x"]`` into a nested dict, validating that each key exists."""
    tree: dict[str, Any] = {}
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        key, raw = item.split("=", 1)
        _set_path(tree, key.strip(), _parse_value(raw.strip()))
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``extra`` into a copy of ``base``."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, raising ConfigError naming the file on any problem."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}", hint="pass an existing YAML file")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        if isinstance(exc, UnicodeDecodeError):
            raise ConfigError(f"{p}: not valid YAML (not UTF-8 text: {exc.reason})") from None
        raise ConfigError(parse_error_text(p, "YAML", exc)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections")
    return data


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None,
    preset: dict[str, Any] | None = None,
) -> ConvergentConfig:
    """Load defaults <- ``preset`` (a command's own defaults, e.g. the demo's) <- YAML file
    (optional) <- ``--set`` overrides, validated."""
    source = str(path) if path is not None else "config"
    user = read_yaml(path) if path is not None else {}
    _check_moved(user, source, path)
    data = _merge(preset or {}, user)
    data = _merge(data, parse_overrides(overrides))
    try:
        return ConvergentConfig.model_validate(data)
    except ValidationError as exc:
        if overrides and _override_caused(exc, overrides):
            raise _format_validation_error(exc, "--set") from None
        raise _format_validation_error(exc, source, path) from None


def _override_caused(exc: ValidationError, overrides: list[str]) -> bool:
    """True if the first validation error is at a key given with ``--set``."""
    field = ".".join(str(p) for p in exc.errors()[0]["loc"])
    return any(item.split("=", 1)[0].strip() == field for item in overrides)


def dump_config(cfg: ConvergentConfig) -> str:
    """The resolved config as YAML text."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def save_config(cfg: ConvergentConfig, path: str | Path) -> None:
    """Write the resolved config atomically."""
    atomic_write_text(path, dump_config(cfg))
