"""The single-process run: the same methods as `parallel.run.DistributedRun`, each the one-rank case.

The trainer calls one of these objects at every point where a distributed run talks to other ranks
(parallelize, loss mean, sums of logged counts, agreeing to skip a step, gradient clipping, router counts,
checkpoints, export),
so the loop itself has no single- / multi-process branches. Must not know about ranks or meshes.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import RunConfig
from .checkpoint import load_checkpoint, save_checkpoint


class LocalRun:
    counts_reduce = None  # router counts are already this process's whole batch
    rank, world, is_main = 0, 1, True
    defer_verdict = True  # the trainer reads each step's verdict one step late (trainer.train_step)
    data_rank, data_world, cp_layout = 0, 1, None  # one process reads every row and holds every position

    def __init__(self, cfg: RunConfig, device: torch.device):
        self.cfg, self.device = cfg, device

    def parallelize(self, model: nn.Module) -> nn.Module:
        """No sharding in one process; activation checkpointing applies all the same."""
        if self.cfg.parallel.activation_checkpointing != "none":
            from ..parallel.activation import apply_activation_checkpointing

            apply_activation_checkpointing(model, self.cfg.parallel.activation_checkpointing)
        return model

    def local_part(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def capacity_overflow(self, model: nn.Module) -> str | None:
        return None  # no expert-parallel exchange in one process

    def mean(self, value: float) -> float:
        return value

    def sum(self, values: list[float]) -> list[float]:
        return list(values)

    def all_finite(self, loss: torch.Tensor) -> bool:
        return bool(torch.isfinite(loss))

    def step_verdict(self, loss: torch.Tensor, losses_finite: torch.Tensor, grad_norm: torch.Tensor,
                     targets: float) -> torch.Tensor:
        """[loss, every loss finite (1/0), gradient norm, target tokens] as one float64 tensor on the device,
        with no host read (the trainer reads it later: `trainer.settle`)."""
        return torch.stack([loss.double(), losses_finite.double(), grad_norm.double().to(loss.device),
                            torch.full_like(loss, targets, dtype=torch.float64)])

    def clip(self, params: list[nn.Parameter], max_norm: float | None, scale: bool = True) -> torch.Tensor:
        """The gradient norm; scale: also clip the gradients to max_norm in place."""
        if not scale:
            grads = [p.grad for p in params if p.grad is not None]
            return torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
        return torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))

    def save(self, root, step: int, model, opt, sched, sampler_state: dict):
        return save_checkpoint(root, step, model, opt, sched, sampler_state)

    def load(self, path, model, opt, sched) -> tuple[int, dict]:
        return load_checkpoint(path, model, opt, sched)

    def load_init(self, model: nn.Module, path) -> dict:
        from .build import load_model

        return load_model(path, model)

    def export_model(self, model: nn.Module, path, config: dict, max_shard_bytes: int, **kw) -> None:
        """kw: export_sharded's dtype / value (a split-weights run writes its fp32 weights)."""
        from ..parallel.sharded_io import export_sharded

        export_sharded(model, path, config, max_shard_bytes=max_shard_bytes, **kw)

    def adapter_copy(self, model: nn.Module) -> nn.Module:
        return model

    def finish(self) -> None:
        pass
