"""What the trainer needs from parallel/ when launched by torchrun: one object, one call per hook.

Owns: `DistributedRun` — joins the process group, builds the meshes from `cfg.parallel`, parallelizes the
model, reduces the logged loss, agrees on skipping a non-finite step and on re-running one whose EP exchange
overflowed, clips gradients over both meshes,
all-reduces router counts, saves / loads DCP checkpoints, loads `init_from` and exports the model shard by
shard (parallel/sharded_io.py: no rank ever holds the whole model), and gathers the LoRA adapters onto rank 0. The trainer keeps the loop and talks to this object only through
the methods `train.local.LocalRun` (the single-process run) has too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..config import RunConfig
from .checkpoint import load_distributed, save_distributed
from .expert import check_capacity
from .mesh import ParallelDims, build_parallel_dims, check_spec, init_distributed, shutdown_distributed
from .parallelize import clip_grad_norm_, counts_reduce, parallelize_model
from .sharded_io import export_sharded, gather_adapters, load_init_from


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
        self.counts_reduce = counts_reduce if self.world > 1 else None  # one rank's counts are the batch's
        # The step's verdict is read before its optimizer step under torchrun: reading it one step late, as
        # one process does, made FSDP2 world 1 slower on the H200 (LoRA `small`: 333.7 -> 368.6 and 348.3 ->
        # 386.5 ms/step in two runs, host-bound both ways; benchmarks/RESULTS.md), for a reason not found yet.
        # A one-rank run has no FSDP (parallelize_model) and reads it late, as one process does.
        self.defer_verdict = self.world == 1
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
        t = self.cfg.train  # every rank's EP exchange is sized for the same tokens per forward
        per_fwd = t.grad_accum_steps if t.merge_microbatches else 1
        return parallelize_model(model, self.dims, tokens_per_forward=t.micro_batch_size * per_fwd * t.seq_len
                                 // self.cfg.parallel.cp)

    def capacity_overflow(self, model: nn.Module) -> str | None:
        """Once per step (and evaluation): did an EP exchange overflow its capacity on any rank since the last
        call? Then the capacities have grown and the returned notice says so: the caller re-runs the work.
        Collective (one small all-reduce, one host read)."""
        return check_capacity(model)

    def mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t) / self.world

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (token counts, eval loss sums). Collective."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def step_verdict(self, loss: torch.Tensor, losses_finite: torch.Tensor, grad_norm: torch.Tensor,
                     targets: float) -> torch.Tensor:
        """[mean loss over ranks, every rank's losses finite (1/0), global gradient norm, target tokens summed
        over ranks] as one float64 tensor on the device: one all-reduce, no host read (the trainer reads it
        later: `trainer.settle`). Collective; every rank gets the same verdict."""
        t = torch.stack([loss.double(), (~losses_finite).double(),
                         torch.full_like(loss, targets, dtype=torch.float64)])
        dist.all_reduce(t)
        return torch.stack([t[0] / self.world, (t[1] == 0).double(), grad_norm.double().reshape(()).to(t.device),
                            t[2]])

    def all_finite(self, loss: torch.Tensor) -> bool:
        """Every rank must take the same branch, or the next collective hangs."""
        ok = torch.tensor([1.0 if bool(torch.isfinite(loss)) else 0.0], device=self.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item() > 0)

    def clip(self, params: list[nn.Parameter], max_norm: float | None, scale: bool = True) -> torch.Tensor:
        """The global gradient norm; scale: also clip the gradients to max_norm in place. Collective."""
        return clip_grad_norm_(params, max_norm, self.dims, scale=scale)

    def save(self, root, step: int, model, opt, sched, sampler_state: dict):
        return save_distributed(root, step, model, opt, sched, sampler_state, self.dims)

    def load(self, path, model, opt, sched) -> tuple[int, dict]:
        return load_distributed(path, model, opt, sched, self.dims)

    def load_init(self, model: nn.Module, path) -> dict:
        """`init_from` into the parallelized model: each rank reads only its shards. Collective."""
        return load_init_from(model, path, self.dims)

    def export_model(self, model: nn.Module, path, config: dict, max_shard_bytes: int, **kw) -> None:
        """The trained model as sharded safetensors, each rank writing its own shards (kw: export_sharded's dtype /
        value). Collective."""
        export_sharded(model, path, config, self.dims, max_shard_bytes=max_shard_bytes, **kw)

    def adapter_copy(self, model: nn.Module) -> nn.Module | None:
        """On rank 0, a meta-built model holding the trained LoRA adapters (gathered: they are small) for
        `export_peft`; None elsewhere. The base weights are never gathered. Collective."""
        from ..lora import inject_lora
        from ..models.model import build_model

        state = gather_adapters(model, self.dims)
        if state is None:
            return None
        plain = build_model(self.cfg.model, "meta")
        inject_lora(plain, self.cfg.lora)
        plain.load_state_dict(state, strict=False, assign=True)
        return plain

    def finish(self) -> None:
        shutdown_distributed()
