"""moeadapt.parallel: meshes, FSDP2 + expert parallelism, activation checkpointing, DCP checkpoints.

Parallelism is applied to a built model from outside (the model never imports this package); see
docs/parallel.md for launching with torchrun.
"""

from .activation import apply_activation_checkpointing
from .checkpoint import gather_full_state, load_distributed, save_distributed
from .expert import EPDispatcher, shard_experts
from .mesh import ParallelDims, build_parallel_dims, check_spec, init_distributed, is_launched_distributed
from .parallelize import clip_grad_norm_, counts_reduce, parallelize_model
from .run import DistributedRun

__all__ = ["DistributedRun", "EPDispatcher", "ParallelDims", "apply_activation_checkpointing", "build_parallel_dims",
           "check_spec", "clip_grad_norm_", "counts_reduce", "gather_full_state", "init_distributed",
           "is_launched_distributed", "load_distributed", "parallelize_model", "save_distributed", "shard_experts"]
