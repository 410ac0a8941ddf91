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
        if Path(value).exists():
            if from_dir is None:
                raise ConfigError(f"model {value!r} is a directory; read it with moeadapt.onboard.resolve_model "
                                  "(or pass from_dir=moeadapt.onboard.model_spec_from_dir)")
            return from_dir(value)
        raise ConfigError(f"model {value!r} is neither a preset ({', '.join(preset_names())}) nor an existing directory")
    if isinstance(value, dict):
        value = dict(value)
        base = value.pop("preset", None)
        try:
            if base is not None:
                return get_preset(base, **value)
            return ModelSpec(**value)
        except ValidationError as e:
            raise ConfigError(format_validation_error(e, "model")) from None
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
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    for dotted, v in (overrides or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return build_run_config(raw, str(path), from_dir)
