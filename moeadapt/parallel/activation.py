"""Activation checkpointing per block: "none" | "selective" | "full".

Owns: wrapping `Block.forward` (the instance attribute, so parameter names stay unchanged for checkpoints)
in non-reentrant `torch.utils.checkpoint`, which passes the block's `(x, info)` output through as is.
  full:      keep only the block input; recompute the whole block in backward.
  selective: keep the outputs of GEMMs (mm / addmm / bmm / grouped mm / attention kernels), of our
             Triton KDA, sparse-attention and indexer-KL forwards (the custom ops moeadapt::chunk_kda_fwd, with
             every tensor its backward reads, moeadapt::sparse_attn_fwd and moeadapt::indexer_kl_fwd), of the
             MoE Triton GEMMs (moeadapt::grouped_mm_fwd, moeadapt::grouped_lora_fwd) and of collectives;
             recompute the cheap rest (norms, activations, gates, the MoE permute, the KDA short conv
             moeadapt::causal_conv_silu_fwd) — `create_selective_checkpoint_contexts` with the policy
             below. The Triton ops register on import: `_save_ops()` looks them up when a policy first runs.
  offload (with full): the kept block input goes to host memory (pinned on CUDA) and comes back for the
             recompute, so device memory holds no per-block activation between forward and backward.
A recompute must not count routed tokens twice: the router's `tokens_per_expert` buffer is restored
after every recompute.
Must not change what a block computes.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..models.router import Router


def _ops(*names: str) -> set:
    out = set()
    for n in names:
        ns, _, op = n.partition(".")
        packet = getattr(getattr(torch.ops, ns, None), op, None)
        if packet is not None:
            out.add(packet.default if hasattr(packet, "default") else packet)
    return out


_SAVE_OPS = _ops("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._grouped_mm",
                 "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
                 "aten._scaled_dot_product_cudnn_attention", "aten._scaled_mm",
                 "_c10d_functional.all_to_all_single", "_c10d_functional.wait_tensor",
                 "_c10d_functional.all_gather_into_tensor", "_c10d_functional.reduce_scatter_tensor")
# our Triton forwards (torch.library custom ops, registered when their modules are imported)
_TRITON_SAVE_OPS = ("moeadapt.chunk_kda_fwd", "moeadapt.sparse_attn_fwd", "moeadapt.indexer_kl_fwd",
                    "moeadapt.lightning_indexer", "moeadapt.grouped_mm_fwd", "moeadapt.grouped_lora_fwd")


@functools.cache
def _triton_save_ops() -> frozenset:
    """The Triton forward ops SAC keeps; imports their modules (Triton present) so that they are registered."""
    try:
        from ..ops.dsa import triton_indexer, triton_kl, triton_sparse_attn  # noqa: F401
        from ..ops.kda import triton_kda  # noqa: F401
        from ..ops.moe import triton_grouped_mm  # noqa: F401
    except ImportError:  # no Triton: nothing of ours to keep
        return frozenset()
    return frozenset(_ops(*_TRITON_SAVE_OPS))


def _ignore_profiler_ops_in_sac() -> None:
    """FSDP2's hooks inside a checkpointed block open profiler ranges a different number of times in the
    forward and in the recompute (it unshards in pre-backward instead); SAC must not try to match them."""
    import torch.utils.checkpoint as ckpt

    if hasattr(ckpt, "SAC_IGNORED_OPS"):
        for name in ("_record_function_enter_new", "_record_function_exit", "_record_function_enter"):
            packet = getattr(torch.ops.profiler, name, None)
            if packet is not None:
                ckpt.SAC_IGNORED_OPS.update(getattr(packet, o) for o in packet.overloads())


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    keep = op in _SAVE_OPS or op in _triton_save_ops()
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


class _KeepRouterCounts:
    """Wraps the recompute context: router token counts are left as they were before the recompute."""

    def __init__(self, routers: list[Router], inner):
        self.routers, self.inner = routers, inner

    def __enter__(self):
        self.saved = [r.tokens_per_expert.clone() for r in self.routers]
        return self.inner.__enter__()

    def __exit__(self, *exc):
        out = self.inner.__exit__(*exc)
        with torch.no_grad():
            for r, c in zip(self.routers, self.saved):
                r.tokens_per_expert.copy_(c)
        return out


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class _ToHost(torch.autograd.Function):
    """A host copy of x (pinned, asynchronous on CUDA); the gradient goes back to x's device."""

    @staticmethod
    def forward(ctx, x):
        ctx.device = x.device
        out = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=x.is_cuda)
        out.copy_(x, non_blocking=x.is_cuda)  # stream-ordered: later kernels may reuse x's memory safely
        return out

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.device, non_blocking=True)


def _checkpointed_forward(orig, mode: str, routers: list[Router], offload: bool, rng: bool, *args, **kwargs):
    def context_fn():
        fwd, rec = create_selective_checkpoint_contexts(_selective_policy) if mode == "selective" else (_Null(), _Null())
        return fwd, _KeepRouterCounts(routers, rec)

    if offload:  # checkpoint keeps the host copy; forward and recompute run on a fresh device copy of it
        x, *rest = args
        device = x.device

        def run(x_host, *a, **kw):
            return orig(x_host.to(device, non_blocking=True), *a, **kw)

        return checkpoint(run, _ToHost.apply(x), *rest, use_reentrant=False, context_fn=context_fn,
                          preserve_rng_state=rng, **kwargs)
    return checkpoint(orig, *args, use_reentrant=False, context_fn=context_fn, preserve_rng_state=rng, **kwargs)


def apply_activation_checkpointing(model: nn.Module, mode: str, offload: bool = False) -> None:
    """Checkpoint every block of `model.layers` (before fully_shard, as torchtitan orders it); `offload` (full
    only) keeps each block's input in host memory instead of on the device."""
    if mode not in ("none", "selective", "full"):
        raise ValueError(f"activation_checkpointing={mode!r}; choose none, selective or full")
    if offload and mode != "full":
        raise ValueError(f"offload_activations offloads the block inputs that full recompute keeps; set "
                         f"activation_checkpointing: full (got {mode!r}) or offload_activations: false")
    if mode == "none":
        return
    if mode == "selective":
        _ignore_profiler_ops_in_sac()
    for block in model.layers:
        if getattr(block, "_moeadapt_ac", None):
            continue
        routers = [m for m in block.modules() if isinstance(m, Router)]
        # the RNG state is stashed for the recompute only where the block draws random numbers (dropout): a
        # block without any computes the same without it, and reading the CUDA RNG state is not allowed
        # while a CUDA graph captures the step (train.cuda_graph)
        rng = any(isinstance(m, nn.Dropout) and m.p > 0 for m in block.modules())
        block.forward = functools.partial(_checkpointed_forward, block.forward, mode, routers, offload, rng)
        block._moeadapt_ac = mode
