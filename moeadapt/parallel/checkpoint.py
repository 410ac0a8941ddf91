"""Distributed checkpoints (torch.distributed.checkpoint, DCP) that load onto another world size or EP degree.

Owns: `save_distributed` / `load_distributed` and `gather_full_state` (the whole model on rank 0, for
the final model/adapter export). A checkpoint directory `step_NNNNNNN/` holds
  DCP shards + metadata.json model tensors "model.<name>" (trainable parameters — only the adapters in a
                            LoRA run — and the router biases) and optimizer state "optim.<name>.<key>";
  meta.json                 step, scheduler, data position, learning rates, the saving world size and ep;
  rng/rank_<r>.safetensors  each rank's RNG state (restored when the world size is unchanged).
Nothing in it is a pickle (parallel/safe_dcp.py: JSON metadata, safetensors RNG).
It is written to `.step_NNNNNNN.tmp` by all ranks and renamed by rank 0 after a barrier; `latest` names
the newest (the single-process reader `train.checkpoint.latest_checkpoint` finds it).

Layout independence: a non-expert tensor is a DTensor over the dense mesh and DCP reshards it by itself.
An expert tensor (and its AdamW state) is saved and loaded as a view of this rank's own storage: a DTensor
of the *global* shape [E, ...] over the expert mesh reordered to ("dp_replicate", "ep", "dp_shard_in_ep")
with placements (Replicate, Shard(0), FSDP's dp_shard_in_ep placement): dim 0 cut into ep blocks of E/ep
experts, each cut again the way FSDP cut it. DCP writes each rank's box and reads back into it in place, so
no rank ever gathers experts (or their optimizer state) beyond its shard; any ep / FSDP degree reads it.
Must not decide when to save (the trainer does).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..io import atomic_write_text, replace_dir
from ..models.model import checkpoint_tensors
from ..models.moe import GroupedExperts
from .mesh import ParallelDims
from .safe_dcp import METADATA_FILE, SafeReader, SafeWriter, load_rng, read_safe_metadata, save_rng


def expert_param_names(model: nn.Module) -> set[str]:
    return {f"{mn}.{pn}" for mn, m in model.named_modules() if isinstance(m, GroupedExperts)
            for pn, _ in m.named_parameters()}


def _portable(t: torch.Tensor, is_expert: bool, dims: ParallelDims) -> torch.Tensor:
    """The tensor as it is saved / loaded: an expert tensor (ep > 1) becomes a DTensor of global shape [E, ...]
    that shares this rank's storage (module docstring); every other tensor is itself."""
    if not (is_expert and dims.ep > 1):
        return t
    local = t.to_local() if isinstance(t, DTensor) else t
    shard_pl = Replicate()  # along dp_shard_in_ep: FSDP's placement, or a whole copy when not FSDP-wrapped
    if isinstance(t, DTensor):
        names = t.device_mesh.mesh_dim_names or ()
        if "dp_shard_in_ep" not in names:
            raise ValueError(f"expert tensor sharded over {names}; the checkpoint layout expects dp_shard_in_ep "
                             "(parallelize_model's fully_shard of the experts): change _portable with the layout")
        shard_pl = t.placements[names.index("dp_shard_in_ep")]
        if not (isinstance(shard_pl, Shard) and shard_pl.dim == 0):
            raise ValueError(f"expert tensor placed {shard_pl!r} over dp_shard_in_ep; the checkpoint layout expects "
                             "FSDP's Shard(0): change _portable with the layout")
    gshape = torch.Size((t.shape[0] * dims.ep, *t.shape[1:]))
    return DTensor.from_local(local.detach(), _ckpt_mesh(dims), [Replicate(), Shard(0), shard_pl],
                              run_check=False, shape=gshape, stride=torch.empty(gshape, device="meta").stride())


def _ckpt_mesh(dims: ParallelDims) -> DeviceMesh:
    """The expert mesh's ranks as ("dp_replicate", "ep", "dp_shard_in_ep"): ep outer, FSDP inner, the order in
    which EP slicing and then fully_shard cut dim 0. Layout only: no process groups (nothing communicates)."""
    if "_ckpt_mesh" not in dims.__dict__:
        ranks = dims.expert_mesh.mesh.transpose(1, 2).contiguous()
        dims.__dict__["_ckpt_mesh"] = DeviceMesh(dims.expert_mesh.device_type, ranks, _init_backend=False,
                                                 mesh_dim_names=("dp_replicate", "ep", "dp_shard_in_ep"))
    return dims.__dict__["_ckpt_mesh"]


def _state(model: nn.Module, optimizer, dims: ParallelDims) -> tuple[dict, dict]:
    experts = expert_param_names(model)
    sd = {f"model.{n}": _portable(t, n in experts, dims) for n, t in checkpoint_tensors(model).items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for k, v in optimizer.state.get(p, {}).items():
                if torch.is_tensor(v):
                    sd[f"optim.{names[id(p)]}.{k}"] = _portable(v, names[id(p)] in experts and v.dim() > 0, dims)
    return sd, names


def save_distributed(root: str | Path, step: int, model: nn.Module, optimizer, scheduler, sampler_state: dict,
                     dims: ParallelDims) -> Path:
    """Collective: every rank calls it. Returns the final directory."""
    root = Path(root)
    final, tmp = root / f"step_{step:07d}", root / f".step_{step:07d}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    dist.barrier()
    sd, _ = _state(model, optimizer, dims)
    dcp.save(sd, storage_writer=SafeWriter(str(tmp)))
    save_rng(tmp / "rng" / f"rank_{rank}.safetensors")
    if rank == 0:
        meta = {"step": step, "scheduler": scheduler.state_dict(), "sampler": sampler_state,
                "lrs": [g["lr"] for g in optimizer.param_groups], "world_size": dims.world_size, "ep": dims.ep,
                "parallel": dims.spec.model_dump()}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=float))
    dist.barrier()  # every shard is on disk before the rename makes the checkpoint visible
    if rank == 0:
        replace_dir(tmp, final)
        atomic_write_text(root / "latest", final.name)
    dist.barrier()
    return final


def load_distributed(path: str | Path, model: nn.Module, optimizer, scheduler, dims: ParallelDims) -> tuple[int, dict]:
    """Restore in place (any world size / ep degree); returns (step, sampler_state). Collective."""
    path = Path(path)
    if not (path / "meta.json").is_file() or not any((path / f).is_file() for f in (METADATA_FILE, ".metadata")):
        raise FileNotFoundError(f"{path} is not a distributed checkpoint (no meta.json / {METADATA_FILE}); was the "
                                "save interrupted, or was it written by a single-process run (resume without torchrun)?")
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path / 'meta.json'} is corrupt ({e}); resume from an earlier step_* checkpoint") from None
    saved = read_safe_metadata(path).state_dict_metadata
    experts = expert_param_names(model)
    own = checkpoint_tensors(model)
    want = {f"model.{n}" for n in own}
    have = {k for k in saved if k.startswith("model.")}
    if want != have:
        raise ValueError(f"checkpoint {path} does not fit this run: missing {sorted(want - have)[:6]}, unexpected "
                         f"{sorted(have - want)[:6]}; resume with the same model and lora config")
    # every target is this rank's own storage (experts: viewed at their global shape): DCP reads in place
    sd = {f"model.{n}": _portable(t.detach(), n in experts, dims) for n, t in own.items()}
    names = {id(p): n for n, p in model.named_parameters()}
    opt_targets = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            n = names[id(p)]
            for key in sorted(k for k in saved if k.startswith(f"optim.{n}.") and "." not in k[len(f"optim.{n}."):]):
                k = key[len(f"optim.{n}."):]
                if len(saved[key].size) == 0:
                    state = torch.zeros((), dtype=saved[key].properties.dtype)
                else:  # AdamW's own layout: like the parameter (a DTensor shard of it under FSDP)
                    state = torch.zeros_like(p.detach())
                sd[key] = _portable(state, n in experts and state.dim() > 0, dims)
                opt_targets.append((p, k, state))
    for key, tgt in sd.items():
        if tuple(tgt.shape) != tuple(saved[key].size) and len(saved[key].size) > 0:
            raise ValueError(f"checkpoint {path}: {key} has shape {tuple(saved[key].size)}, this run's is "
                             f"{tuple(tgt.shape)}; resume with the model and lora config (e.g. lora.rank) the run "
                             "was saved with, or start a new output_dir")
    dcp.load(sd, storage_reader=SafeReader(str(path)))
    for p, k, state in opt_targets:
        optimizer.state.setdefault(p, {})[k] = state
    for g, lr in zip(optimizer.param_groups, meta["lrs"]):
        g["lr"] = lr
    scheduler.load_state_dict(meta["scheduler"])
    rng_file = path / "rng" / f"rank_{dist.get_rank()}.safetensors"
    if meta["world_size"] == dims.world_size and rng_file.is_file():
        load_rng(rng_file)
    else:  # another world size: per-rank streams cannot carry over; derive fresh ones from the step
        torch.manual_seed(int(meta["step"]) * 1000003 + dist.get_rank())
    return int(meta["step"]), meta["sampler"]


@torch.no_grad()
def gather_full_state(model: nn.Module, dims: ParallelDims) -> dict[str, torch.Tensor] | None:
    """Every parameter and buffer, unsharded, on rank 0 (CPU); None on the other ranks. Collective."""
    experts = expert_param_names(model)
    out = {}
    for n, t in model.state_dict().items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if n in experts and dims.ep > 1:
            parts = [torch.empty_like(full) for _ in range(dims.ep)]
            dist.all_gather(parts, full.contiguous(), group=dims.ep_group)
            full = torch.cat(parts)
        if dist.get_rank() == 0:
            out[n] = full.detach().cpu()
    return out if dist.get_rank() == 0 else None
