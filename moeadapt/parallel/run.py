"""What the trainer needs from parallel/ when launched by torchrun: one object, one call per hook.

Owns: `DistributedRun` — joins the process group, builds the meshes from `cfg.parallel`, parallelizes the
model, reduces the logged loss and counts, agrees on skipping a non-finite step, clips gradients over both meshes,
all-reduces router counts, saves / loads DCP checkpoints, and gathers the final model onto rank 0 as a
plain (unsharded) model for the export. The trainer keeps the loop and talks to this object only through
the methods `train.local.LocalRun` (the single-process run) has too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..config import RunConfig
from .checkpoint import gather_full_state, load_distributed, save_distributed
from .mesh import ParallelDims, build_parallel_dims, check_spec, init_distributed
from .parallelize import clip_grad_norm_, counts_reduce, parallelize_model


class DistributedRun:
    def __init__(self, cfg: RunConfig, device: torch.device):
        self.cfg = cfg
        self.device = init_distributed(device)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        try:
            check_spec(cfg.parallel, cfg.model, self.world)
        except ValueError as e:
            raise ValueError(f"rank {self.rank}: {e}") from None
        self.dims: ParallelDims = build_parallel_dims(cfg.parallel, cfg.model, self.device)
        self.counts_reduce = counts_reduce
        # the ranks of a cp group read the same rows and each keeps its pieces of them (`local_part`)
        self.data_rank, self.data_world = self.dims.dp_rank, self.dims.dp_size
        self.cp_layout = self.dims.cp_layout()

    def local_part(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's pieces (along time) of a [B, T] batch under context parallelism; t itself otherwise."""
        return t if self.cp_layout is None else self.cp_layout.split(t)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def parallelize(self, model: nn.Module) -> nn.Module:
        return parallelize_model(model, self.dims)

    def mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t) / self.world

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (token counts, eval loss sums). Collective."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def all_finite(self, loss: torch.Tensor) -> bool:
        """Every rank must take the same branch, or the next collective hangs."""
        ok = torch.tensor([1.0 if bool(torch.isfinite(loss)) else 0.0], device=self.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item() > 0)

    def clip(self, params: list[nn.Parameter], max_norm: float | None) -> torch.Tensor:
        return clip_grad_norm_(params, max_norm, self.dims)

    def save(self, root, step: int, model, opt, sched, sampler_state: dict):
        return save_distributed(root, step, model, opt, sched, sampler_state, self.dims)

    def load(self, path, model, opt, sched) -> tuple[int, dict]:
        return load_distributed(path, model, opt, sched, self.dims)

    def unsharded_copy(self, model: nn.Module) -> nn.Module | None:
        """A plain CPU model with the trained weights on rank 0 (None elsewhere), for the export. Collective."""
        from ..lora import inject_lora
        from ..models.model import build_model, materialize

        state = gather_full_state(model, self.dims)
        if state is None:
            return None
        plain = materialize(build_model(self.cfg.model, "meta"), "cpu", seed=self.cfg.train.seed)
        if self.cfg.lora is not None:
            inject_lora(plain, self.cfg.lora)
        plain.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=True)
        return plain

    def finish(self) -> None:
        dist.barrier()
        dist.destroy_process_group()
