"""nn.Modules of the hybrid model (DESIGN.md §3). Never imports parallel/."""

from .model import Block, HybridMoEModel, ModelOutput, build_model, materialize
from .stats import count_parameters

__all__ = ["Block", "HybridMoEModel", "ModelOutput", "build_model", "count_parameters", "materialize"]
