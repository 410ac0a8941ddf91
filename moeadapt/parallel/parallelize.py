"""Apply parallelism to a built model (torchtitan-style): EP, activation checkpointing, FSDP2.

Owns: `parallelize_model` (order: slice experts and swap in the EP dispatcher -> checkpoint blocks ->
`fully_shard` experts over dp_shard_in_ep, then each block and the root over dp_shard (HSDP when
dp_replicate > 1); a one-rank run is not sharded), the gradient-norm clip that spans both meshes, and the
router-count all-reduce.
Mixed precision: bf16 parameters with fp32 gradient reduction on GPU; fp32 throughout on CPU.

Gradient scale: every rank's loss is the mean over its own tokens (under cp: its token-weighted share of its
sequences' loss x cp) and the global loss is the mean over ranks. FSDP divides dense gradients by the dense mesh size (= world). An expert gradient already sums the
contributions of all ep ranks' tokens through the all-to-all, and FSDP divides it by its own mesh size
(world / ep); the missing 1/ep is applied by EPDispatcher inside autograd (expert.py). (FSDP's
`set_gradient_divide_factor` would do it too, but needs PREMUL_SUM, which gloo lacks, and double-divides
when the expert shard group has one rank.)
Must not change what the model computes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ..lora.layers import GroupedLoRALinear
from ..models.model import set_context_parallel
from ..models.moe import GroupedExperts, LatentMoE
from ..models.router import Router
from .activation import apply_activation_checkpointing
from .expert import EPDispatcher, shard_experts
from .mesh import ParallelDims
from .sharded_io import local


def parallelize_model(model: nn.Module, dims: ParallelDims, dispatch_timing: dict | None = None,
                      tokens_per_forward: int | None = None) -> nn.Module:
    """In place; call after LoRA injection and before building the optimizer: on the meta-built model (the
    scale-true build, train/build.py: then `to_empty` + parallel.shards.fill_shards) or on a materialised one.
    tokens_per_forward (this rank's tokens in one forward, the trainer's micro-batch) sizes the EP exchange's
    capacity on every rank alike; None: each EP layer sizes it at its first call."""
    spec = dims.spec
    if dims.world_size == 1:
        # FSDP over one rank shards nothing and reduces nothing, yet each block still copies its parameters into
        # and out of an all-gather buffer and runs FSDP's hooks: the LoRA `small` step took 362 ms under FSDP2
        # at world 1 vs 234 ms in one process (H200, host-bound; benchmarks/RESULTS.md). A one-rank run keeps
        # plain parameters and no collective in its step, as one process does (torchtitan likewise applies FSDP
        # only when dp_shard * cp > 1), and the experts keep their [W | Bᵀ] buffers. DCP checkpoints, sharded
        # export and `init_from` take a plain tensor as the whole tensor, so a one-rank checkpoint loads at any
        # world size and back.
        apply_activation_checkpointing(model, spec.activation_checkpointing, spec.offload_activations)
        return model
    if spec.cp > 1:  # each rank holds pieces of every sequence; KDA / DSA exchange states and keys
        set_context_parallel(model, dims.cp_layout())
    for m in model.modules():  # the global-batch aux loss counts every rank's tokens
        if isinstance(m, Router) and hasattr(m, "global_counts_reduce"):
            m.global_counts_reduce = counts_reduce
    if spec.ep > 1:
        shard_experts(model, spec.ep, dims.ep_rank)
        for m in model.modules():
            if isinstance(m, LatentMoE):
                m.dispatcher = EPDispatcher(dims.ep_group, spec.a2a_chunks, timing=dispatch_timing,
                                            capacity_factor=spec.ep_capacity_factor, tokens=tokens_per_forward,
                                            top_k=m.spec.n_experts_per_tok)
    apply_activation_checkpointing(model, spec.activation_checkpointing, spec.offload_activations)
    for m in model.modules():  # a grouped LoRA base that is a view of a [W | Bᵀ] or gate/up buffer is not contiguous
        if isinstance(m, (GroupedLoRALinear, GroupedExperts)):
            m.release_cat()
    if dims.device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    dense_mesh, raf = dims.dense_fsdp_mesh(), spec.reshard_after_forward
    for block in model.layers:
        if spec.ep > 1 and isinstance(block.ffn, LatentMoE):
            fully_shard(block.ffn.experts, mesh=dims.expert_fsdp_mesh(), reshard_after_forward=raf, mp_policy=mp)
        fully_shard(block, mesh=dense_mesh, reshard_after_forward=raf, mp_policy=mp)
    if getattr(model, "vision", None) is not None:  # the vision tower (+ merger, projector): one FSDP unit
        fully_shard(model.vision, mesh=dense_mesh, reshard_after_forward=raf, mp_policy=mp)
    fully_shard(model, mesh=dense_mesh, reshard_after_forward=False, mp_policy=mp)
    return model


def counts_reduce(t: torch.Tensor) -> None:
    """Sum per-expert token counts over all ranks (every rank routes its own tokens) — for
    `update_expert_bias(model, counts_reduce=...)`."""
    dist.all_reduce(t)


@torch.no_grad()
def clip_grad_norm_(params: list[nn.Parameter], max_norm: float | None, dims: ParallelDims,
                    scale: bool = True) -> torch.Tensor:
    """Global L2 norm over dense and expert gradients (both meshes); scales grads in place when above max_norm.

    Each element of a gradient lives once per replica, and both meshes are replicated dp_replicate times,
    so the norm is the all-reduced local sum of squares / dp_replicate. scale=False: the norm only (the trainer
    hands the clip to a fused AdamW as its grad_scale: `train.trainer.clip_divisor`)."""
    local_grads = [local(p.grad) for p in params if p.grad is not None]
    # foreach kernels (a few launches for all gradients, grouped by dtype) rather than ~4 launches per gradient:
    # the step is host-bound under FSDP, and a model has hundreds of trainable tensors
    sq = (torch.nn.utils.get_total_norm(local_grads, 2.0, foreach=True).float().pow(2) if local_grads
          else torch.zeros((), dtype=torch.float32, device=dims.device))
    dist.all_reduce(sq)
    total = (sq / dims.spec.dp_replicate).sqrt()
    if scale and max_norm is not None and max_norm > 0:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in local_grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for dt, gs in by_dtype.items():
            torch._foreach_mul_(gs, coef.to(dt))
    return total
