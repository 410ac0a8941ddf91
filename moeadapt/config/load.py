"""YAML loading and model resolution, with errors a user can act on.

Owns: turning a YAML file / preset name / mapping into validated specs. Imports nothing of moeadapt outside
config/: a model directory (ours or a Hugging Face checkpoint) is read by onboard/ — callers pass
`from_dir=moeadapt.onboard.model_spec_from_dir` (moeadapt.api does).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from .presets import get_preset, preset_names
from .schema import ModelSpec, RunConfig


class ConfigError(ValueError):
    """A configuration problem; the message names the field and the fix."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that rejects a key given twice in one mapping (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(None, None, f"unhashable key {key!r}",
                                                        key_node.start_mark) from None
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping (first on line {seen[key] + 1}, again on "
                    f"line {key_node.start_mark.line + 1}); keep one", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def safe_load_yaml(text: str, where: str):
    """YAML -> Python objects (no tags that build objects); duplicate keys are an error naming `where`."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        loc = f"{where}, line {mark.line + 1} column {mark.column + 1}" if mark else where
        what = "; ".join(x for x in (e.context, e.problem) if x)
        raise ConfigError(f"{loc}: not valid YAML ({what})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {' '.join(str(e).split())}") from None


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """`--set KEY=VALUE` items (VALUE parsed as YAML) -> {dotted key: value}; errors name the item."""
    out: dict[str, Any] = {}
    for it in items or []:
        if "=" not in it:
            raise ConfigError(f"--set expects KEY=VALUE (e.g. train.steps=100), got {it!r}")
        k, v = it.split("=", 1)
        if not k or any(not p.isidentifier() for p in k.split(".")):
            raise ConfigError(f"--set {it!r}: {k!r} is not a dotted field name such as train.lr")
        if not v.strip():
            raise ConfigError(f"--set {it!r} has no value; give KEY=VALUE")
        try:
            out[k] = safe_load_yaml(v, f"--set {it!r}: the value")
        except ConfigError as e:
            raise ConfigError(f"{e}; write the value as YAML, e.g. train.betas=[0.9,0.95]") from None
    return out


def apply_overrides(raw: dict, overrides: dict[str, Any], where: str) -> None:
    """Set dotted keys in the raw config mapping; a dotted key that runs through a non-mapping is an error."""
    for dotted, v in (overrides or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for i, p in enumerate(parents):
            nxt = node.setdefault(p, {})
            if isinstance(nxt, str) and i == 0 and p == "model":  # model: NAME -> {preset: NAME} to override fields
                nxt = node[p] = {"preset": nxt}
            if not isinstance(nxt, dict):
                at = ".".join(parents[:i + 1])
                raise ConfigError(f"--set {dotted}={v!r}: {at} is {nxt!r} in {where}, not a section; set {at}=VALUE "
                                  "or a field of a section (e.g. train.lr)")
            node = nxt
        node[leaf] = v


def format_validation_error(err: ValidationError, where: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; unknown keys are rejected)"
        lines.append(f"{where}: {loc}: {msg}")
    return "\n".join(lines)


FromDir = Callable[[str], ModelSpec]  # a model directory -> its ModelSpec (onboard.model_spec_from_dir)


def resolve_model(value: str | dict | ModelSpec, from_dir: FromDir | None = None) -> ModelSpec:
    """A preset name, a model directory (read by `from_dir`), a ModelSpec mapping (optionally with `preset:` +
    overrides)."""
    if isinstance(value, ModelSpec):
        return value
    if isinstance(value, str):
        if value in preset_names():
            return get_preset(value)
        if Path(value).is_dir():
            if from_dir is None:
                raise ConfigError(f"model {value!r} is a directory; read it with moeadapt.onboard.resolve_model "
                                  "(or pass from_dir=moeadapt.onboard.model_spec_from_dir)")
            return from_dir(value)
        if Path(value).exists():
            raise ConfigError(f"model {value!r} is a file; give a model directory (config.json + model.safetensors) "
                              f"or a preset ({', '.join(preset_names())})")
        raise ConfigError(f"model {value!r} is neither a preset ({', '.join(preset_names())}) nor an existing directory")
    if isinstance(value, dict):
        value = dict(value)
        base = value.pop("preset", None)
        try:
            if base is not None:
                if not isinstance(base, str) or base not in preset_names():
                    raise ConfigError(f"model.preset {base!r} is not a preset; choose one of {preset_names()}")
                return get_preset(base, **value)
            return ModelSpec(**value)
        except ValidationError as e:
            raise ConfigError(format_validation_error(e, "model")) from None
        except TypeError as e:  # a non-string key
            raise ConfigError(f"model: {e}") from None
    raise ConfigError(f"model must be a preset name, a directory or a mapping, got {type(value).__name__}")


def build_run_config(raw: dict[str, Any], where: str = "config", from_dir: FromDir | None = None) -> RunConfig:
    """A RunConfig from a parsed mapping; `from_dir` reads a `model:` that names a directory."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: the top level must be a mapping with keys model/lora/train/data/parallel")
    if "model" not in raw:
        raise ConfigError(f"{where}: missing 'model' (a preset name such as 'tiny', a directory, or a mapping)")
    raw = dict(raw)
    try:
        raw["model"] = resolve_model(raw["model"], from_dir)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if raw.get("lora") is True:
        raw["lora"] = {}
    try:
        return RunConfig(**raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, where)) from None


def load_run_config(path: str | Path, overrides: dict[str, Any] | None = None,
                    from_dir: FromDir | None = None) -> RunConfig:
    """A RunConfig from a YAML file with dotted `overrides`; `from_dir` as in build_run_config."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config {path} is a directory; give a YAML file (examples/*.yaml)")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    raw = safe_load_yaml(text, str(path))
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping with keys model/lora/train/data/parallel")
    apply_overrides(raw, overrides or {}, str(path))
    return build_run_config(raw, str(path), from_dir)
