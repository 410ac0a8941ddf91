"""YAML loading and model resolution, with errors a user can act on.

Owns: turning a YAML file / preset name / model directory into validated specs.
"""

from __future__ import annotations

import json
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


def model_spec_from_dir(path: str | Path) -> ModelSpec:
    """A model directory: ours (config.json holding our ModelSpec) or a Hugging Face checkpoint of a family
    `moeadapt onboard` maps (deepseek_v3, deepseek_v32, kimi_k2, kimi_linear, qwen3_moe)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{path} has no config.json; give a preset name ({', '.join(preset_names())}) "
                          "or a model directory")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_file} is not valid JSON ({e}); re-export the model") from e
    if "moeadapt" not in cfg:  # a Hugging Face checkpoint: map it through onboarding (lazy: onboard imports torch)
        from ..onboard.families import OnboardError, read_family

        try:
            return read_family(cfg, name=path.name).spec
        except OnboardError as e:
            raise ConfigError(f"{cfg_file}: {e}; inspect it with `moeadapt onboard {path}`") from None
    try:
        return ModelSpec(**cfg["moeadapt"])
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, str(cfg_file))) from None


def resolve_model(value: str | dict | ModelSpec) -> ModelSpec:
    """A preset name, a model directory, a ModelSpec mapping (optionally with `preset:` + overrides)."""
    if isinstance(value, ModelSpec):
        return value
    if isinstance(value, str):
        if value in preset_names():
            return get_preset(value)
        if Path(value).exists():
            return model_spec_from_dir(value)
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


def build_run_config(raw: dict[str, Any], where: str = "config") -> RunConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: the top level must be a mapping with keys model/lora/train/data/parallel")
    if "model" not in raw:
        raise ConfigError(f"{where}: missing 'model' (a preset name such as 'tiny', a directory, or a mapping)")
    raw = dict(raw)
    try:
        raw["model"] = resolve_model(raw["model"])
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if raw.get("lora") is True:
        raw["lora"] = {}
    try:
        return RunConfig(**raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, where)) from None


def load_run_config(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
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
    return build_run_config(raw, str(path))
