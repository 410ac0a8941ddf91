"""Distributed checkpoints (torch.distributed.checkpoint, DCP) that load onto another world size or EP degree.

Owns: `save_distributed` / `load_distributed` and `gather_full_state` (the whole model on rank 0, for
the final model/adapter export). A checkpoint directory `step_NNNNNNN/` holds
  DCP shards + `.metadata`  model tensors "model.<name>" (trainable parameters — only the adapters in a
                            LoRA run — and the router biases) and optimizer state "optim.<name>.<key>";
  meta.json                 step, scheduler, data position, learning rates, the saving world size and ep;
  rng/rank_<r>.pt           each rank's RNG state (restored when the world size is unchanged).
It is written to `.step_NNNNNNN.tmp` by all ranks and renamed by rank 0 after a barrier; `latest` names
the newest (the single-process reader `train.checkpoint.latest_checkpoint` finds it).

Layout independence: a non-expert tensor is a DTensor over the dense mesh and DCP reshards it by itself.
An expert tensor is saved as a DTensor of the *global* shape [E, ...] sharded over the ep mesh dimension
(this rank's E/ep experts, gathered over dp_shard_in_ep first), so any ep / FSDP degree can read it back.
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
from torch.distributed.tensor import DTensor, Shard

from ..io import atomic_write_text, replace_dir
from ..models.model import checkpoint_tensors
from ..models.moe import GroupedExperts
from .mesh import ParallelDims


def expert_param_names(model: nn.Module) -> set[str]:
    return {f"{mn}.{pn}" for mn, m in model.named_modules() if isinstance(m, GroupedExperts)
            for pn, _ in m.named_parameters()}


def _portable(t: torch.Tensor, is_expert: bool, dims: ParallelDims) -> torch.Tensor:
    """The tensor as it is saved: experts (ep > 1) become an ep-sharded DTensor of global shape [E, ...]."""
    if not (is_expert and dims.ep > 1):
        return t
    local = t.full_tensor() if isinstance(t, DTensor) else t
    return DTensor.from_local(local.detach(), dims.expert_mesh["ep"], [Shard(0)], run_check=False)


def _shard_like(full_local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `full_local` in the layout of `like` (an FSDP DTensor or a plain tensor)."""
    if not isinstance(like, DTensor):
        return full_local
    t, mesh = full_local, like.device_mesh
    coord = mesh.get_coordinate()
    for i, pl in enumerate(like.placements):
        if isinstance(pl, Shard):
            pieces = torch.chunk(t, mesh.size(i), dim=pl.dim)
            t = pieces[coord[i]] if coord[i] < len(pieces) else t.narrow(pl.dim, 0, 0)
    return t


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
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp)))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, tmp / "rng" / f"rank_{rank}.pt")
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
    if not (path / "meta.json").is_file() or not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a distributed checkpoint (no meta.json / .metadata); was the save "
                                "interrupted, or was it written by a single-process run (resume without torchrun)?")
    meta = json.loads((path / "meta.json").read_text())
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    experts = expert_param_names(model)
    own = checkpoint_tensors(model)
    want = {f"model.{n}" for n in own}
    have = {k for k in saved if k.startswith("model.")}
    if want != have:
        raise ValueError(f"checkpoint {path} does not fit this run: missing {sorted(want - have)[:6]}, unexpected "
                         f"{sorted(have - want)[:6]}; resume with the same model and lora config")
    sd = {f"model.{n}": (_portable(torch.zeros_like(t), True, dims) if n in experts and dims.ep > 1 else t.detach())
          for n, t in own.items()}
    names = {id(p): n for n, p in model.named_parameters()}
    opt_targets = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            n = names[id(p)]
            for key in sorted(k for k in saved if k.startswith(f"optim.{n}.") and "." not in k[len(f"optim.{n}."):]):
                k = key[len(f"optim.{n}."):]
                size = saved[key].size
                if len(size) == 0:
                    tgt = torch.zeros((), dtype=saved[key].properties.dtype)
                else:
                    tgt = _portable(torch.zeros_like(p.detach()), n in experts, dims)
                sd[key] = tgt
                opt_targets.append((p, n, k, key))
    dcp.load(sd, storage_reader=dcp.FileSystemReader(str(path)))
    with torch.no_grad():
        for n, t in own.items():
            if n in experts and dims.ep > 1:
                loaded = sd[f"model.{n}"].to_local()
                dst = t.to_local() if isinstance(t, DTensor) else t
                dst.copy_(_shard_like(loaded, t))
        for p, n, k, key in opt_targets:
            v = sd[key]
            if v.dim() > 0 and n in experts and dims.ep > 1:
                local = _shard_like(v.to_local(), p)
                v = DTensor.from_local(local.clone(), p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride()) if isinstance(p, DTensor) else local.clone()
            optimizer.state.setdefault(p, {})[k] = v
    for g, lr in zip(optimizer.param_groups, meta["lrs"]):
        g["lr"] = lr
    scheduler.load_state_dict(meta["scheduler"])
    rng_file = path / "rng" / f"rank_{dist.get_rank()}.pt"
    if meta["world_size"] == dims.world_size and rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
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
