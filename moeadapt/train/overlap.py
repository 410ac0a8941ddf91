"""The optimizer step run beside the next step's forward (`train.overlap_optimizer`, with `train.cuda_graph` and
the bf16 weight copies' CopyAdamW).

Why: full fine-tuning's AdamW is memory-bound (28 bytes a parameter: ~29 ms of a ~179 ms `small` step on one
H100, at 87% of the memory bandwidth), while the forward is mostly GEMMs and KDA that leave bandwidth unused.
Run one after the other, their times add up.

How: the captured step (train/graph.py) begins with the update of the previous replay's gradients on a second
stream, one launch per forward stage (`models.model.forward_stages`: the embedding, each layer, the final norm and
head), in the order the forward reads them; each stage's end is an event. The forward waits for a stage's event
right before it reads that stage's weights (`HybridMoEModel.stage_hook`), so layer i's update runs beside the
forward of the layers before it. The backward, which writes the gradients afresh, starts after the last stage's
event. The values are those of the steps one after the other, bit for bit: the same kernels on the same inputs;
only the order between the update and the next forward's other stages changes.

What changes from step to step lives on the device at fixed addresses, written between replays by `queue`: the
skip flag (1: nothing to apply: the first replay, a skipped step, or after `flush`), the clip divisor and each
parameter group's lr. The gradients are the ones the graph's backward writes into its memory pool; the captured
kernels find them through gradient tables pointed at them after the capture (`TensorTable.point`). Where the host
needs the updated weights (an eval, a checkpoint, the end: `trainer.settle`) `flush` applies the queued step at
once, eagerly.
"""

from __future__ import annotations

import torch

from ..models.model import HybridMoEModel, forward_stages
from ..ops.host import host_tensor
from ..ops.optim.triton_adamw import ALIGN, TensorTable
from ..parallel.optim import CopyAdamW


def why_not(cfg, run, opt, model) -> str | None:
    """Why this run does not overlap its optimizer step with the next forward (None: it does)."""
    if not cfg.train.overlap_optimizer:
        return "train.overlap_optimizer is off"
    if not isinstance(opt, CopyAdamW):
        return "it needs the bf16 weight copies' CopyAdamW (train.weight_copies)"
    if not run.defer_verdict:
        return "the step's verdict is read before its optimizer step"
    if not isinstance(model, HybridMoEModel):
        return f"{type(model).__name__} has no forward stages"
    return None


class NextStepUpdate:
    """CopyAdamW's step of one replay's gradients, captured at the start of the next replay (module docstring)."""

    def __init__(self, opt: CopyAdamW, model: HybridMoEModel, clip: bool):
        self.opt, self.model = opt, model
        dev = next(p.device for g in opt.param_groups for p in g["params"])
        self.skip = torch.ones((), device=dev)  # found_inf of the queued step; 1: nothing queued
        self.scale = torch.ones((), device=dev) if clip else None  # its clip divisor
        self.lr = torch.zeros(len(opt.param_groups), device=dev)  # its lr per parameter group
        self.queued_lr: list[float] | None = None
        self.stages: list[list[tuple]] = []  # per forward stage: (group index, grad dtype, copied, params, table)
        self.events: list[torch.cuda.Event] = []
        self.side: torch.cuda.Stream | None = None
        self.why_not: str | None = "not prepared"  # why the captured step leaves it out (None: it does not)
        self.live = False  # captured: each replay applies the step queued before it

    def prepare(self) -> None:
        """After an eager backward (the gradients present, the optimizer state made by an earlier step): the
        launches per stage, each with a gradient table to point at the graph's gradients later."""
        opt = self.opt
        group_of = {p: gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}
        staged, self.stages = set(), []
        for stage in forward_stages(self.model):
            parts: dict[tuple, list] = {}
            for p in stage:
                g = p.grad
                if p not in group_of or g is None:
                    continue
                if not g.is_contiguous() or g.data_ptr() % (ALIGN * g.element_size()):
                    self.why_not = f"a gradient of shape {list(g.shape)} is a view off the kernels' alignment"
                    return
                if not opt.state.get(p):
                    self.why_not = "the optimizer has no state yet (it is made by the first step)"
                    return
                parts.setdefault((group_of[p], g.dtype, p in opt.copies), []).append(p)
                staged.add(p)
            self.stages.append([(gi, dt, cp, ps, TensorTable.placeholder(len(ps), dt, ps[0].device))
                                for (gi, dt, cp), ps in parts.items()])
        missed = [p for p in group_of if p.grad is not None and p not in staged]
        if missed:
            self.why_not = f"{len(missed)} trained tensors are not parameters of the model's forward stages"
            return
        self.events = [torch.cuda.Event() for _ in self.stages]
        self.why_not = None

    def launch(self) -> None:
        """Inside the capture, before the forward: every stage's update on the side stream, and the model told
        to wait for each stage before reading it."""
        main = torch.cuda.current_stream()
        self.side = self.side or torch.cuda.Stream(main.device)
        self.side.wait_stream(main)
        groups = self.opt.param_groups
        with torch.cuda.stream(self.side):
            for si, parts in enumerate(self.stages):
                for gi, dt, cp, ps, g_tab in parts:
                    self.opt._launch(gi, groups[gi], cp, ps, g_tab, ("next", si, gi, dt, cp), self.lr[gi],
                                     self.skip, self.scale)
                self.events[si].record(self.side)  # recorded for an empty stage too: the forward waits on each
        self.model.stage_hook = self._wait

    def _wait(self, stage: int) -> None:
        torch.cuda.current_stream().wait_event(self.events[stage])

    def captured(self, ok: bool) -> None:
        """After the capture: the gradient tables pointed at the gradients the graph's backward writes."""
        self.model.stage_hook = None
        if not ok:
            return
        for parts in self.stages:
            for _, _, _, ps, g_tab in parts:
                g_tab.point([p.grad for p in ps])
        self.live = True

    def queue(self, found_inf: torch.Tensor, grad_scale: torch.Tensor | None) -> None:
        """The step of the gradients just computed, to be applied by the next replay (or `flush`): its skip flag,
        clip divisor and lrs written where the captured kernels read them (on the device: no host wait)."""
        self.skip.copy_(found_inf)
        if self.scale is not None:
            self.scale.copy_(grad_scale if grad_scale is not None else torch.ones_like(self.scale))
        self.queued_lr = [g["lr"] for g in self.opt.param_groups]
        self.lr.copy_(host_tensor(self.queued_lr, self.lr.device, dtype=torch.float32))

    def replayed(self) -> None:
        """A replay has applied the queued step (it read the flags before this call's next `queue`)."""
        self.queued_lr = None

    def flush(self) -> None:
        """Apply the queued step now (eagerly, on the gradients the last replay wrote); the next replay then
        applies nothing until a step is queued again."""
        if self.queued_lr is None:
            return
        opt = self.opt
        if [g["lr"] for g in opt.param_groups] != self.queued_lr:
            raise RuntimeError("the lr changed between queueing an optimizer step and applying it")
        opt.found_inf, opt.grad_scale = self.skip, self.scale
        try:
            opt.step()
        finally:
            opt.__dict__.pop("found_inf", None)
            opt.__dict__.pop("grad_scale", None)
        opt.zero_grad(set_to_none=True)
        self.skip.fill_(1.0)
        self.queued_lr = None
