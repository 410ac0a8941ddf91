"""Configuration: pydantic schemas, presets and YAML loading. See schema.py for every field."""

from .load import ConfigError, build_run_config, format_validation_error, load_run_config, resolve_model
from .presets import get_preset, preset_names
from .schema import DataSpec, LoRASpec, ModelSpec, ParallelSpec, RopeScaling, RunConfig, TrainSpec, VisionSpec

__all__ = [
    "ConfigError", "DataSpec", "LoRASpec", "ModelSpec", "ParallelSpec", "RopeScaling", "RunConfig", "TrainSpec",
    "VisionSpec", "build_run_config", "format_validation_error", "get_preset", "load_run_config", "preset_names",
    "resolve_model",
]
