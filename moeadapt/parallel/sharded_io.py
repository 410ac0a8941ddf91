"""Which box of each global tensor this rank holds, and the sharded load / export built on it.

Owns: `Region` / `model_regions` (for every tensor of a built, possibly parallelized model: its global shape,
the offset and shape of this rank's local box, and whether this rank is the one that writes the box when
several ranks hold it), `load_sharded` (fill every local box from a checkpoint source, each rank reading only
its boxes), `export_sharded` (Hugging Face-style sharded safetensors, each rank pwrite-ing its boxes into
files whose headers rank 0 lays out from metadata) and `gather_adapters` (the LoRA tensors, small, on rank 0).

A tensor is one of: a plain tensor (the whole tensor, every rank), an FSDP2 DTensor (its box from the
device mesh and placements), or an expert tensor sliced by `shard_experts` to experts [ep_rank * E/ep, ...)
(then FSDP-sharded over dp_shard_in_ep: the box is the FSDP box shifted by the rank's first expert).
Must not change what the model computes; sources (moeadapt/onboard/sources.py) know nothing of ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..io import DEFAULT_MAX_SHARD_BYTES, write_sharded_dir
from ..models.moe import GroupedExperts
from .mesh import ParallelDims


@dataclass(frozen=True)
class Region:
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]  # where this rank's box starts in the global tensor
    shape: tuple[int, ...]  # this rank's box
    owner: bool  # the one rank among those holding this box that writes it on export

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offset, self.shape))


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's storage of a tensor (a DTensor's local shard)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _expert_names(model: nn.Module) -> set[str]:
    return {f"{mn}.{pn}" for mn, m in model.named_modules() if isinstance(m, GroupedExperts)
            for pn, _ in m.named_parameters()}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tensor_region(t: torch.Tensor, is_expert: bool, dims: ParallelDims | None) -> Region:
    if isinstance(t, DTensor):
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        coord = t.device_mesh.get_coordinate() or [0] * t.device_mesh.ndim
        owner = all(c == 0 for c, p in zip(coord, t.placements) if not p.is_shard())
        gshape = tuple(t.shape)
    else:
        shape, offset, gshape = tuple(t.shape), (0,) * t.dim(), tuple(t.shape)
        if dims is not None and is_expert and dims.ep > 1:  # sliced but not FSDP-wrapped: one copy per ep rank
            coord = dims.expert_mesh.get_coordinate()
            owner = coord[0] == 0 and coord[1] == 0
        else:
            owner = _rank() == 0
    shape, offset = tuple(shape), tuple(offset)
    if dims is not None and is_expert and dims.ep > 1:  # shift by this ep rank's first expert
        n_local = gshape[0]
        gshape = (n_local * dims.ep, *gshape[1:])
        offset = (offset[0] + dims.ep_rank * n_local, *offset[1:])
    return Region(gshape, offset, shape, owner)


def model_regions(model: nn.Module, dims: ParallelDims | None = None,
                  adapters: bool = False) -> dict[str, tuple[torch.Tensor, Region]]:
    """State-dict name -> (tensor, region) for every persistent tensor (LoRA adapters only if `adapters`)."""
    experts = _expert_names(model) if dims is not None and dims.ep > 1 else set()
    out = {}
    for n, t in model.state_dict(keep_vars=True).items():
        if n.endswith("tokens_per_expert") or (not adapters and (".lora_A" in n or ".lora_B" in n)):
            continue
        out[n] = (t, tensor_region(t, n in experts, dims))
    return out


def _agree(err: BaseException | None, what: str) -> None:
    """Every rank raises if any rank failed (so none goes on into a collective the others never reach)."""
    if dist.is_initialized():
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        ok = torch.tensor([0.0 if err else 1.0], device=dev)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if err is None and ok.item() == 0:
            raise RuntimeError(f"another rank failed {what}; its error is in its log")
    if err is not None:
        raise err


@torch.no_grad()
def load_sharded(model: nn.Module, source, dims: ParallelDims | None = None,
                 skip_prefixes: tuple[str, ...] = ()) -> dict:
    """Fill every local box of `model` (materialised or `to_empty`-ed, parallelized or not) from `source`
    (`moeadapt.onboard.sources.open_source(path)`). Checks names and shapes on every rank before reading;
    LoRA adapters are left as they are, router token counters are zeroed; tensors named with one of
    `skip_prefixes` keep what they hold (a text checkpoint loaded into a vision-language model: the fresh
    vision tower). Returns {"tensors", "bytes_read", "local_bytes"} for this rank."""
    regs = {n: v for n, v in model_regions(model, dims).items() if not n.startswith(skip_prefixes)}
    err = None
    try:
        source.check({n: r.global_shape for n, (_, r) in regs.items()})
    except Exception as e:  # noqa: BLE001 - re-raised on this rank by _agree, after the others know
        err = e
    _agree(err, "to check init_from")
    seen, items = set(), []
    for n, (t, r) in regs.items():
        if id(t) in seen:  # tied weights: one storage
            continue
        seen.add(id(t))
        items.append((n, r.global_shape, r.slices, local(t)))
    source.fill(items)
    for m_name, b in model.named_buffers():
        if m_name.endswith("tokens_per_expert"):
            b.zero_()
    return {"tensors": len(items), "bytes_read": source.bytes_read,
            "local_bytes": sum(d.numel() * d.element_size() for *_, d in items)}


def load_init_from(model: nn.Module, path, dims: ParallelDims | None = None) -> dict:
    """`init_from` (any checkpoint `open_source` reads) into the built model's local shards. A text checkpoint
    loaded into a vision-language model leaves the (freshly initialised) vision tower as it is."""
    from ..onboard.sources import open_source, source_has

    source = open_source(path)
    fresh_vision = getattr(model, "vision", None) is not None and not source_has(source, "vision.")
    return load_sharded(model, source, dims, skip_prefixes=("vision.",) if fresh_vision else ())


# -- export ---------------------------------------------------------------------------------------------------
class IdentityLayout:
    """Our names and shapes, unchanged (a moeadapt model directory)."""

    def dests(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        return [(name, shape)]

    def pieces(self, name: str, region: Region, box: torch.Tensor) -> Iterator[tuple[str, tuple[int, ...], torch.Tensor]]:
        yield name, region.offset, box


def export_sharded(model: nn.Module, path: str | Path, config: dict, dims: ParallelDims | None = None,
                   layout=None, dtype: torch.dtype | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                   extra_files: dict[str, str] | None = None,
                   keep_dtype: Callable[[str], bool] = lambda n: n.endswith("expert_bias"),
                   value: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Path:
    """Write the model as safetensors files of <= max_shard_bytes (`model.safetensors`, or
    `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`) + config.json (+ `extra_files`).
    Collective under torch.distributed: every rank writes only the boxes it owns; no tensor is gathered.
    Atomic (`moeadapt.io.write_sharded_dir`). `layout` maps our tensors to the output's (default ours;
    `moeadapt.onboard.loader.HFLayout` for a Hugging Face checkpoint's names); `dtype` casts floating
    tensors except those `keep_dtype` names; `value` gives the tensor to write for one of the model's (its local
    shard; default the tensor itself: CopyAdamW.full_weight writes split weights whole, one at a time). LoRA
    adapters are not written (see `gather_adapters`)."""
    layout = layout or IdentityLayout()
    regs = model_regions(model, dims)
    claimed: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    order, writes = [], []
    for n, (t, r) in regs.items():
        out_dtype = dtype if (dtype is not None and t.is_floating_point() and not keep_dtype(n)) else t.dtype
        mine = False
        for dn, dshape in layout.dests(n, r.global_shape):
            if dn in claimed:  # tied weights / two of ours on one checkpoint tensor: the first one writes it
                continue
            claimed[dn] = (tuple(dshape), out_dtype)
            order.append((dn, tuple(dshape), out_dtype))
            mine = True
        if mine:
            writes.append((n, t, r))

    def write(emit) -> None:
        for n, t, r in writes:
            if r.owner and 0 not in r.shape:
                for dn, off, piece in layout.pieces(n, r, local(t if value is None else value(t)).detach()):
                    emit(dn, off, piece)

    return write_sharded_dir(path, order, config, write, max_shard_bytes, extra_files)


@torch.no_grad()
def gather_adapters(model: nn.Module, dims: ParallelDims | None = None) -> dict[str, torch.Tensor] | None:
    """The LoRA adapter tensors (small), whole, on rank 0 (CPU); None on the other ranks. Collective."""
    experts = _expert_names(model) if dims is not None and dims.ep > 1 else set()
    out = {}
    for n, p in model.named_parameters():
        if ".lora_A" not in n and ".lora_B" not in n:
            continue
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if n in experts:
            parts = [torch.empty_like(full) for _ in range(dims.ep)]
            dist.all_gather(parts, full.contiguous(), group=dims.ep_group)
            full = torch.cat(parts)
        if _rank() == 0:
            out[n] = full.cpu().clone()
    return out if _rank() == 0 else None
