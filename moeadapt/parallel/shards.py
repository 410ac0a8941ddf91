"""Which slice of each global tensor this rank holds, and filling those slices: the last step of the
scale-true build (DESIGN.md §4 "Build order").

    model = build_model(spec, "meta")        # no storage anywhere
    inject_lora(model, lora)                 # adapters on meta too
    parallelize_model(model, dims)           # EP slicing + fully_shard, still on meta (world 1: skip)
    model.to_empty(device=device)            # each rank allocates its own shards only
    fill_shards(model, fill)                 # writes every local shard from `fill`

The fill contract (for initialisation and for checkpoint readers alike):

    fill(name: str, global_shape: tuple[int, ...], local_slices: tuple[slice, ...]) -> torch.Tensor

`name` is the tensor's name in the *unsharded* model (`model.named_parameters()` / `named_buffers()`,
identical at every world size), `global_shape` its full shape (an expert tensor: all E experts), and
`local_slices` one `slice(start, stop)` per dimension: the part this rank owns, in global coordinates
(`torch.empty(global_shape)[local_slices]` has the local shape). The returned tensor must have exactly that
shape; its dtype may differ (the copy casts: a loader may return the checkpoint's bf16 and the shard keeps
fp32, or the other way round). `fill` is called once per tensor, on every rank, in `named_tensors` order;
a slice may be empty (an FSDP shard past the end of dim 0), and then `fill` is not called. Buffers (router
bias and counts) are never sharded: their slice is the whole tensor.
Today's layouts: FSDP2 shards dim 0 (torch.chunk sizes, DTensor `Shard(0)`), EP keeps experts
[ep_rank * E/ep, (ep_rank + 1) * E/ep) of dim 0, the two composed for experts; so the slices are a dim-0
range with every other dimension whole. Readers may rely on that and must fail clearly when it changes.

`models.init.init_fill(model, seed)` is the initialising fill; a checkpoint reader is another one. Owns also
`shard_bytes`: the bytes of this rank's weights, gradients and AdamW state (the runtime side of the
planner's accounting, plan/memory.py `state_bytes`). Must not decide what goes into a tensor (fill does).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..models.init import Fill
from .sharded_io import local as local_shard


def named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, nn.Module]]:
    """(name, tensor, owning module) for every parameter (tied ones once) and buffer of the model."""
    seen = set()
    for mn, m in model.named_modules():
        pre = f"{mn}." if mn else ""
        for pn, p in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False)):
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            yield pre + pn, p, m


def global_layout(t: torch.Tensor, owner: nn.Module) -> tuple[tuple[int, ...], tuple[slice, ...]]:
    """(global shape, this rank's slices) of a (possibly FSDP-sharded, possibly EP-sliced) tensor."""
    shape = tuple(t.shape)
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        slices = [slice(o, o + n) for o, n in zip(offset, local_shape)]
    else:
        slices = [slice(0, n) for n in shape]
    rng = getattr(owner, "expert_range", None)  # set by parallel.expert.shard_experts: (first expert, E)
    if rng is not None and t.dim() > 0 and isinstance(t, nn.Parameter | DTensor):
        lo, n_global = rng
        shape = (n_global, *shape[1:])
        slices[0] = slice(slices[0].start + lo, slices[0].stop + lo)
    return shape, tuple(slices)


@torch.no_grad()
def fill_shards(model: nn.Module, fill: Fill) -> None:
    """Write every local shard of `model` (allocated, e.g. by `to_empty`) from `fill` (module docstring)."""
    for name, t, owner in named_tensors(model):
        local = local_shard(t)
        if local.numel() == 0:
            continue
        shape, slices = global_layout(t, owner)
        src = fill(name, shape, slices)
        if tuple(src.shape) != tuple(local.shape):
            raise ValueError(f"fill gave {name} the shape {tuple(src.shape)} for slices {slices} of global shape "
                             f"{shape}; this rank's shard is {tuple(local.shape)}")
        local.copy_(src)


def shard_bytes(model: nn.Module, moment_bytes: int = 4, lo_bytes: int = 0) -> dict[str, int]:
    """This rank's bytes of weights, gradients (trainable parameters, in their dtype) and optimizer state
    (AdamW's exp_avg and exp_avg_sq, `moment_bytes` each per trainable element, and `lo_bytes` of a split
    weight's low half: train.weight_dtype fp32_split, whose split weights are the bf16 trainable ones), and the
    largest single local tensor. What `AdamW` and autograd allocate for these shards; compare
    plan.memory.state_bytes."""
    weights = grads = largest = trainable = halves = 0
    for _, t, _ in named_tensors(model):
        if not isinstance(t, nn.Parameter):
            continue
        local = local_shard(t)
        b = local.numel() * local.element_size()
        weights += b
        largest = max(largest, b)
        if t.requires_grad:
            grads += b
            trainable += local.numel()
            halves += local.numel() if t.dtype == torch.bfloat16 else 0
    return {"weights": weights, "grads": grads, "optimizer": 2 * moment_bytes * trainable + lo_bytes * halves,
            "largest_tensor": largest}
