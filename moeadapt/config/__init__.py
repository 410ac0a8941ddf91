"""Configuration: pydantic schemas, presets and YAML loading. See schema.py for every field."""

from .load import ConfigError, build_run_config, load_run_config, model_spec_from_dir, resolve_model
from .presets import get_preset, preset_names
from .schema import DataSpec, LoRASpec, ModelSpec, ParallelSpec, RopeScaling, RunConfig, TrainSpec, VisionSpec

__all__ = [
    "ConfigError", "DataSpec", "LoRASpec", "ModelSpec", "ParallelSpec", "RopeScaling", "RunConfig", "TrainSpec", "VisionSpec",
    "build_run_config", "get_preset", "load_run_config", "model_spec_from_dir", "preset_names", "resolve_model",
]
