"""The training loop: one file a reader can follow from data to optimizer step.

`train(cfg)` sets a run up (model built on meta with LoRA when cfg.lora is set, parallelized on meta, each
rank's shards allocated and filled from the seeded init, then `init_from` read shard by shard into them:
build.py; AdamW + warmup/cosine, resume), evaluates, calls `fit`, evaluates again and
writes the results: `model/` (full training) or `adapter/` (PEFT, LoRA runs), `metrics.jsonl`,
`report.png`, `summary.json`. `fit` is the loop; `train_step` is one optimizer step (grad accumulation,
bf16 autocast on GPU with fp32 trainable params, fp32 on CPU, grad clipping, router-bias update).
A NaN/Inf loss or gradient norm skips the step with a warning (the weights are never updated with it, and
non-finite weights are never saved). In one process the fused AdamW applies or skips each step on the device,
and the host reads the step's verdict while the next step is queued (`train_step`, `settle`): no step waits for
the device (under torchrun the verdict is read before the optimizer step: `DistributedRun.defer_verdict`).
`max_bad_steps` in a row stop the run with a clear error. A step whose batch holds no target token is skipped and counted. Resume takes the checkpoint `latest` names, else the
newest complete step_* (falling back to older ones when one does not load); a changed lr / schedule takes
effect from the resumed step. Interrupts and a full disk end the run with one message naming the newest
checkpoint.

Everything that differs between one process and torchrun goes through `run`: a `LocalRun` (local.py) or a
`parallel.DistributedRun`, which have the same methods; the loop has no branch on which one it is.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from ..config import RunConfig
from ..data.dataset import Sampler, build_datasets
from ..data.multimodal import MultimodalDataset, MultimodalSampler, build_mm_datasets
from ..data.tokenizer import get_tokenizer
from ..io import atomic_write_text
from ..lora import export_peft
from ..models.model import HybridMoEModel, checkpoint_tensors
from ..models.router import Router, update_expert_bias
from ..models.stats import attention_flops_per_token, count_parameters
from ..models.vision import ImageBatch
from ..ops.host import to_device, to_host
from ..parallel.optim import CopyAdamW, build_optimizer
from ..ui import make_console
from .build import build_meta, materialize_shards
from .checkpoint import clean_partial_saves, latest_checkpoint, prune_checkpoints, resume_candidates
from .copies import WeightCopies, plan_copies, resolve_weight_dtype, store_bf16, why_not_bf16
from .copies import why_not as why_not_copies
from .errors import TrainingError
from .graph import WARMUP as GRAPH_WARMUP
from .graph import StepGraph, check_graphable, resolve_cuda_graph
from .local import LocalRun
from .metrics import MetricsLogger, NullLogger, load_quantiles, plot_report
from .vl import evaluate_vl

if TYPE_CHECKING:
    from ..parallel import DistributedRun

console = make_console()


@dataclass
class TrainResult:
    output_dir: Path
    eval_before: float
    eval_after: float
    final_loss: float
    tokens_per_s: float  # wall clock over the whole loop (first steps' kernel compiles and evals included)
    steps: int
    accuracy_before: dict | None = None  # vision-language runs: evaluate_vl's answer accuracy (overall, by question)
    accuracy_after: dict | None = None
    tokens_per_s_steady: float | None = None  # train steps only, after the first steady_skip(lp) (the speed)


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainingError("train.device is 'cuda' but no GPU is visible; use device: auto or cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def _autocast(device: torch.device, dtype: str):
    if device.type == "cuda" and dtype in ("auto", "bf16"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _exact(run, model, fn, retry=None):
    """fn() again while an expert-parallel exchange overflowed its capacity during it (the capacity has grown
    by then: `run.capacity_overflow`), so what fn computed is the dropless result. `retry(notice)` runs before
    each re-run (say so, drop what fn left behind); by default rank 0 prints the notice. Collective under
    torchrun."""
    while True:
        out = fn()
        notice = run.capacity_overflow(model) if run is not None else None
        if notice is None:
            return out
        if retry is not None:
            retry(notice)
        elif run.is_main:
            console.print(f"[yellow]{notice}")


@torch.no_grad()
def evaluate(model, ds, cfg: RunConfig, device, n_batches: int | None = None, run=None) -> float:
    """Mean loss per target token over the first `n_batches` (default eval_batches) micro-batches of every
    data-parallel rank: rank r takes batches r, r + world, ... and the sums are added over ranks (the ranks of
    a cp group take the same rows, each its pieces; their losses are shares x cp, so the sum over the group
    counts each row cp times, as it counts its targets). Every rank runs the same number of forwards (FSDP and
    EP forwards are collective): one past the end repeats batch 0 at weight 0. A multimodal eval set is
    evaluated by `evaluate_vl` (train/vl.py). Re-run whole when an EP exchange overflowed (`_exact`)."""
    if isinstance(ds, MultimodalDataset):
        return _exact(run, model, lambda: evaluate_vl(model, ds, cfg.train.micro_batch_size, device,
                                                      n_batches or cfg.train.eval_batches,
                                                      lambda: _autocast(device, cfg.train.dtype)))["loss"]
    tot, cnt = _exact(run, model, lambda: _eval_sums(model, ds, cfg, device, n_batches, run))
    if run is not None:
        tot, cnt = run.sum([tot, cnt])
    return tot / max(cnt, 1)


def _eval_sums(model, ds, cfg: RunConfig, device, n_batches: int | None, run) -> tuple[float, int]:
    """This rank's (loss x targets, targets) over its eval batches (see `evaluate`)."""
    world, rank = (run.data_world, run.data_rank) if run is not None else (1, 0)
    model.eval()
    bs = cfg.train.micro_batch_size
    nb = min(-(-len(ds) // bs), (n_batches or cfg.train.eval_batches) * world)
    tot, cnt = 0.0, 0
    for b in range(rank, -(-nb // world) * world, world):
        i = b * bs if b < nb else 0
        x, y, extra = ds.batch(slice(i, i + bs))
        x, y = x.to(device), y.to(device)
        k = int((y != -100).sum()) if b < nb else 0  # the whole rows' tokens (before the cp split)
        if run is not None:
            x, y = run.local_part(x), run.local_part(y)
        with _autocast(device, cfg.train.dtype):
            out = model(x, y, return_logits=False, **_model_inputs(extra, run, device))
        if k:
            tot += float(out.loss) * k
            cnt += k
    model.train()
    return tot, cnt


def lr_lambda(cfg: RunConfig):
    t = cfg.train

    def f(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / max(1, t.warmup_steps)
        prog = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, prog)))

    return f


def flops_per_token(model, cfg: RunConfig) -> float:
    counts = count_parameters(model, cfg.model)
    trainable_frac = 1.0 if cfg.lora is None else 2 / 3  # LoRA skips the weight-gradient GEMMs of the base
    return 6 * trainable_frac * (counts["active_per_token"] - counts["by_component"].get("embeddings", 0))


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return 790e12 if ("H200" in name or "H100" in name) else None  # measured bf16 dense on H200


def start_run(cfg: RunConfig) -> LocalRun | DistributedRun:
    """A DistributedRun under torchrun (even with one process: FSDP2 + EP + DCP, docs/parallel.md), else a
    LocalRun. Both have the same methods; the returned object's `device` is this rank's device."""
    device = pick_device(cfg.train.device)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from ..parallel import DistributedRun

        return DistributedRun(cfg, device)
    return LocalRun(cfg, device)


@dataclass
class Loop:
    """What the loop works on; built once by `train`."""

    cfg: RunConfig
    run: LocalRun | DistributedRun
    model: HybridMoEModel
    params: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    sampler: Sampler
    logger: MetricsLogger | NullLogger
    eval_ds: object
    flops_per_token: float
    quiet: bool
    tokens_done: int = 0
    step: int = 0  # the step being computed (0-based); messages number steps from 1 like the progress lines
    skipped_nonfinite: int = 0
    skipped_no_targets: int = 0
    start: int = 0  # the step fit started from (it logs that one)
    queued: _Queued | None = None  # the step whose verdict is not read yet (train_step, settle)
    graph: StepGraph | None = None  # train.cuda_graph: the forwards and backwards captured and replayed
    graph_released: str | None = None  # why a captured graph was released mid-run (the steps then ran eagerly)
    copies: WeightCopies | None = None  # bf16 compute copies of the weights the forward borrows (copies.py)
    # attention's own FLOPs per token at train.seq_len (models.stats), for the MFU that counts them
    attention_flops_per_token: float = field(init=False)

    def __post_init__(self) -> None:
        self.attention_flops_per_token = attention_flops_per_token(self.cfg.model, self.cfg.train.seq_len)

    def say(self, msg: str) -> None:
        """Run messages (warnings included) come from rank 0 only."""
        if self.run.is_main:
            console.print(msg)


@dataclass
class StepStats:
    loss: float | torch.Tensor  # a device scalar until the step's verdict is read (`settle`)
    grad_norm: float | torch.Tensor
    tokens: int
    step: int = 0  # the step's index (0-based, like Loop.step)
    skipped: str | None = None  # "nonfinite_loss" / "nonfinite_grad" / "no_targets": nothing was applied
    aux: dict[str, float | torch.Tensor] = field(default_factory=dict)  # host copies on the steps fit logs
    counts: dict[int, torch.Tensor] = field(default_factory=dict)  # per MoE layer; summed over ranks when logged
    drops: dict[int, float | torch.Tensor] = field(default_factory=dict)
    # host clock (perf_counter) by which the step's work was done, for the logged tokens/s: the end of its
    # queuing where the work was done by the time the host read it (the CPU runs it as it is queued; a host-bound
    # GPU step), else the end of the read's wait for it
    done_at: float | None = None


@dataclass
class _Queued:
    """A step whose work is queued: `verdict` ([mean loss, every loss finite, gradient norm, target tokens] over
    ranks) is on its way to the host; `done` (CUDA) is recorded after the step's last kernel."""

    st: StepStats
    verdict: torch.Tensor
    done: torch.cuda.Event | None = None


def _discard_step(lp: Loop) -> None:
    """Drop what a skipped step accumulated: gradients and the router's token counts."""
    lp.opt.zero_grad(set_to_none=True)
    for m in lp.model.modules():
        if isinstance(m, Router):
            m.tokens_per_expert.zero_()


def _stack(parts: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Micro-batches (inputs, labels, the model's other inputs) stacked along the batch: one forward's rows."""
    extra = {k: ImageBatch.cat(v) if k == "images" else torch.cat(v)
             for k, v in ((k, [p[2][k] for p in parts]) for k in parts[0][2])}
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), extra


def _model_inputs(extra: dict, run, device) -> dict:
    """The batch's other model inputs: position_ids split over cp like the tokens (`run`'s local_part; None:
    whole), left on the host without cp (the model reads the documents' boundaries there, with no device sync);
    images whole, on the device."""
    out = {}
    if extra.get("position_ids") is not None:
        pos = extra["position_ids"]
        if getattr(run, "cp_layout", None) is not None:
            pos = run.local_part(to_device(pos, device))
        out["position_ids"] = pos
    if extra.get("images") is not None:
        out["images"] = extra["images"].to(device)
    return out


def _rng_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_state(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _forward_backward(lp: Loop, batches: list, per_fwd: int) -> tuple[StepStats, torch.Tensor]:
    """Forward + backward of the step's forwards, gradients accumulated, with no host sync: the loss stays a
    device scalar, and whether every loss was finite is returned as a device bool (train_step reads both once,
    at the end of the step; a NaN loss only makes NaN gradients, which that read then drops)."""
    t, run, model, device = lp.cfg.train, lp.run, lp.model, lp.run.device
    n_fwd = len(batches)
    st = StepStats(loss=torch.zeros((), device=device), grad_norm=torch.zeros(()), tokens=0)
    finite = torch.ones((), dtype=torch.bool, device=device)
    for xb, yb, extra in batches:
        # sent without waiting for the device (ops/host.py); under cp: this rank's pieces
        x, y = run.local_part(to_device(xb, device)), run.local_part(to_device(yb, device))
        with _autocast(device, t.dtype), (lp.copies.lent() if lp.copies else contextlib.nullcontext()):
            out = model(x, y, return_logits=False, micro_batches=per_fwd, **_model_inputs(extra, run, device))
            loss = out.loss + out.aux_loss
        finite &= torch.isfinite(loss.detach())
        (loss / n_fwd).backward()
        st.loss = st.loss + out.loss.detach().float() / n_fwd
        for k, v in out.aux.items():
            st.aux[k] = st.aux.get(k, 0.0) + v / n_fwd
        for m in out.moe:  # counts stay on the device: read back only on log steps
            st.counts[m["layer"]] = st.counts.get(m["layer"], 0) + m["counts"].float()
            st.drops[m["layer"]] = st.drops.get(m["layer"], 0.0) + m["drop_rate"] / n_fwd
        st.tokens += x.numel()  # this rank's; summed over ranks when logged
    return st, finite


def _skips_on_device(lp: Loop) -> bool:
    """A fused torch AdamW/Adam takes `found_inf` (a device flag: 1 leaves every parameter, moment and step
    count as they were), so the step can be applied or skipped without the host reading the verdict first; the
    run says whether to (`defer_verdict`)."""
    return lp.run.defer_verdict and _fused_adam(lp)


def _fused_adam(lp: Loop) -> bool:
    """The optimizer takes `found_inf` and `grad_scale` on the device (torch's fused Adam / AdamW, CopyAdamW)."""
    opt = lp.opt
    return isinstance(opt, CopyAdamW) or (bool(opt.defaults.get("fused"))
                                         and isinstance(opt, torch.optim.Adam | torch.optim.AdamW))


def make_optimizer(cfg: RunConfig, run, model: HybridMoEModel,
                   params: list[torch.nn.Parameter]) -> tuple[torch.optim.Optimizer, WeightCopies | None]:
    """The run's AdamW and, where the run takes them (copies.why_not), the bf16 weight copies it writes; with
    train.weight_dtype bf16 / fp32_split, the trained weights first stored in bf16 (copies.store_bf16: no copies
    then); auto is settled first (copies.resolve_weight_dtype)."""
    cfg = resolve_weight_dtype(cfg, run, run.device)
    why = why_not_bf16(cfg, run, run.device)
    if why:
        raise TrainingError(why)
    lows = {} if cfg.train.weight_dtype == "fp32_split" else None  # the fp32 weights' low halves, kept exactly
    if cfg.train.weight_dtype != "fp32":  # bf16 / fp32_split: the parameters themselves bf16, no copies
        store_bf16(model, lows)
    copies = plan_copies(model, cfg, run, run.device)
    opt = build_optimizer(params, cfg.train, run.device, copies.by_weight() if copies else None)
    if lows:
        opt.seed_low_halves(lows)
    return opt, copies


def clip_divisor(grad_norm: torch.Tensor, max_norm: float | None) -> torch.Tensor | None:
    """The gradient clip as a fused Adam's `grad_scale` (it divides every gradient by it inside its one kernel):
    max(1, (norm + 1e-6) / max_norm), torch's clip_grad_norm_ coefficient inverted; None without a clip. Instead
    of a pass that scales every gradient in place before the optimizer reads them (full fine-tuning of `small`:
    `_foreach_mul_` over 2.9B fp32 gradients, 6.4 ms of a 256 ms step on the H200)."""
    if not max_norm:
        return None
    return ((grad_norm.float() + 1e-6) / max_norm).clamp(min=1.0)


def _logged(lp: Loop, step: int) -> bool:
    t = lp.cfg.train
    return (step + 1) % t.log_every == 0 or step == t.steps - 1 or step == lp.start


def _for_log(lp: Loop, st: StepStats) -> None:
    """On the steps fit logs: the MoE counts and drop rates summed over ranks (on the device, collective) and
    every logged statistic on its way to the host; on the others they are dropped."""
    if not _logged(lp, st.step):
        st.aux, st.counts, st.drops = {}, {}, {}
        return
    reduce, world = lp.run.counts_reduce, lp.run.world
    if reduce is not None:
        for layer in sorted(st.counts):
            reduce(st.counts[layer])
        keys = sorted(k for k, v in st.drops.items() if isinstance(v, torch.Tensor))
        if keys:
            d = torch.stack([st.drops[k].float() for k in keys])
            reduce(d)
            st.drops.update(zip(keys, (d / world).unbind(0)))
    st.aux = {k: to_host(v) for k, v in st.aux.items()}
    st.counts = {k: to_host(v) for k, v in st.counts.items()}
    st.drops = {k: to_host(v) for k, v in st.drops.items()}


def _read(q: _Queued) -> StepStats:
    """The verdict of a queued step, read on the host (waiting for that step only): its loss, gradient norm and
    whether it was skipped."""
    st = q.st
    if q.done is not None and not q.done.query():  # still running: it ends when the wait does
        q.done.synchronize()
        st.done_at = time.perf_counter()
    loss, losses_ok, grad_norm, targets = q.verdict.tolist()
    if st.done_at is None:  # read as soon as queued (no deferred read): done once its verdict is here
        st.done_at = time.perf_counter()
    st.loss, st.grad_norm = loss, grad_norm
    if targets == 0:  # the same verdict on every rank
        st.skipped = "no_targets"
    elif not losses_ok:
        st.skipped = "nonfinite_loss"
    elif not math.isfinite(grad_norm):
        st.skipped = "nonfinite_grad"
    return st


def settle(lp: Loop) -> StepStats | None:
    """The queued step's verdict (None when no step is queued): the lr schedule advances when it was applied.
    train_step calls this once the next step's forward and backward are queued, so the device has long finished
    the step read; fit calls it before an eval, a checkpoint or the end."""
    q, lp.queued = lp.queued, None
    if q is None:
        return None
    st = _read(q)
    if st.skipped is None:
        lp.sched.step()
    return st


def _evaluate(lp: Loop, done: int) -> float:
    """The eval loss after `done` steps. A captured step graph keeps its memory pool between replays, so an eval
    runs beside it; if the eval does not fit there (CUDA out of memory), the graph is released (its pool freed) and
    the eval run again, and the steps after it run eagerly: said once, and in summary.json."""
    try:
        return evaluate(lp.model, lp.eval_ds, lp.cfg, lp.run.device, run=lp.run)
    except torch.cuda.OutOfMemoryError:
        if lp.graph is None or lp.graph.graph is None:
            raise
    # outside the except block, so that the failed eval's tensors (held by its traceback) are gone
    lp.graph.release()
    lp.graph = None
    lp.graph_released = (f"released after step {done}: an eval did not fit beside the captured step's "
                         "memory; the steps after it ran eagerly")
    lp.say(f"[yellow]train.cuda_graph: {lp.graph_released}")
    return evaluate(lp.model, lp.eval_ds, lp.cfg, lp.run.device, run=lp.run)


def use_cuda_graph(lp: Loop) -> None:
    """train.cuda_graph: the step's forwards and backwards are captured once and replayed (train/graph.py)."""
    why = check_graphable(lp.cfg, lp.run)
    if why:
        raise TrainingError(f"train.cuda_graph: {why}")
    t = lp.cfg.train
    per_fwd = t.grad_accum_steps if t.merge_microbatches else 1
    lp.graph = StepGraph(lp.params, lambda batches: _forward_backward(lp, batches, per_fwd), lp.run.device)


def train_step(lp: Loop) -> StepStats | None:
    """One optimizer step (step lp.step) over grad_accum_steps micro-batches, queued on the device with no host
    read. Returns the step whose verdict this call read: with a fused AdamW in one process the previous one (None
    at first; `settle` reads the last), which the device skipped (nothing applied) if its loss or gradient norm
    was NaN/Inf or its batch (over all ranks) had no target token; otherwise (another optimizer, torchrun) this
    step, read before it is applied. When an expert-parallel exchange overflowed its capacity (read once, after
    the backward: the capacity grows), the gradients are dropped and the same micro-batches run again from the
    same RNG state, so the step applied is always the dropless one."""
    t, run, model, device = lp.cfg.train, lp.run, lp.model, lp.run.device
    # merge_microbatches: one forward over all micro-batches (experts batched), else one per micro-batch
    per_fwd = t.grad_accum_steps if t.merge_microbatches else 1
    n_fwd = t.grad_accum_steps // per_fwd
    batches = [_stack([lp.sampler.next() for _ in range(per_fwd)]) for _ in range(n_fwd)]
    # this rank's target tokens, counted on the host (the batch is still there); summed over ranks in the
    # step's verdict: a step whose batch has no target on any rank is skipped there, after its (zero) forward,
    # rather than costing every step a collective and a wait before the forward
    targets = float(sum(int((y != -100).sum()) for _, y, _ in batches))
    rng = _rng_state(device)

    def retry(notice: str) -> None:  # an EP exchange overflowed: again on the same batches and RNG state
        lp.say(f"[yellow]step {lp.step + 1}: {notice}")
        _discard_step(lp)
        _set_rng_state(rng, device)

    if lp.graph is not None:
        st, finite = lp.graph(batches)
    else:
        st, finite = _exact(run, model, lambda: _forward_backward(lp, batches, per_fwd), retry)
    st.step = lp.step
    read = settle(lp)  # the previous step: finished on the device while this one's work was queued
    in_opt = _fused_adam(lp)  # the clip applied inside the fused AdamW (its grad_scale), no pass of its own
    if isinstance(lp.opt, CopyAdamW) and run.world == 1:  # one rank; bf16 gradients summed in fp32
        st.grad_norm = lp.opt.grad_norm()
    else:
        st.grad_norm = run.clip(lp.params, t.grad_clip, scale=not in_opt)  # global norm over every rank's shards
    divisor = clip_divisor(st.grad_norm, t.grad_clip) if in_opt else None
    verdict = run.step_verdict(st.loss, finite, st.grad_norm, targets)  # on the device, the same on every rank
    _for_log(lp, st)
    deferred, apply = _skips_on_device(lp), None
    if deferred:  # applied or skipped on the device (found_inf), read one step late
        apply = (verdict[1] > 0) & torch.isfinite(verdict[2]) & (verdict[3] > 0)
        lp.opt.found_inf = (~apply).float()
    else:  # read now, before the optimizer step
        st = _read(_Queued(st, verdict))
        if st.skipped is not None:
            _discard_step(lp)
            return st
    if divisor is not None:
        lp.opt.grad_scale = divisor
    try:
        lp.opt.step()
    finally:
        lp.opt.__dict__.pop("found_inf", None)
        lp.opt.__dict__.pop("grad_scale", None)
    lp.opt.zero_grad(set_to_none=True)
    update_expert_bias(model, counts_reduce=run.counts_reduce, apply=apply)
    if not deferred:
        lp.sched.step()
        return st
    lp.queued = _Queued(st, to_host(verdict))
    if device.type == "cuda":
        lp.queued.done = torch.cuda.Event()
        lp.queued.done.record()
    st.done_at = time.perf_counter()  # the earliest it can end; the read moves it on if it has to wait
    return read


def _weights_finite(lp: Loop) -> bool:
    """Every rank's trainable weights (and router biases) are finite; collective under torchrun."""
    ok = all(bool(torch.isfinite(t.to_local() if hasattr(t, "to_local") else t).all())
             for t in checkpoint_tensors(lp.model).values() if t.is_floating_point())
    return lp.run.all_finite(torch.tensor(0.0 if ok else float("nan"), device=lp.run.device))


def _save(lp: Loop, ckpt_root: Path, step: int) -> None:
    if not _weights_finite(lp):
        raise TrainingError(f"the weights hold NaN/Inf at step {step}; not saving them. Lower train.lr (or enable "
                            "grad_clip) and resume from the last good checkpoint with train.resume=true")
    lp.run.save(ckpt_root, step, lp.model, lp.opt, lp.sched, lp.sampler.state())
    keep = lp.cfg.train.keep_last_checkpoints
    if keep and lp.run.is_main:
        prune_checkpoints(ckpt_root, keep)


_SKIP_WHY = {"nonfinite_loss": "loss is NaN/Inf", "nonfinite_grad": "gradient norm is NaN/Inf"}


# Steps left out of the steady-state speed: the first ones compile and autotune kernels (Triton, torch.compile);
# under train.cuda_graph the step after the graph's eager warm-up is the capture, left out too (steady_skip).
STEADY_SKIP = 2


def steady_skip(lp: Loop) -> int:
    """How many of this process's first steps the steady speed leaves out: STEADY_SKIP, and with a CUDA graph
    every step up to its capture (graph.WARMUP eager steps, then the capturing one: ~3x a replayed step)."""
    return STEADY_SKIP if lp.graph is None else max(STEADY_SKIP, GRAPH_WARMUP + 1)


@dataclass
class Speed:
    """Train-step time and tokens after the first `skip` steps, evals and checkpoint writes left out."""

    seconds: float = 0.0
    tokens: int = 0
    steps: int = 0
    skip: int = STEADY_SKIP

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.steps and self.seconds > 0 else None


def fit(lp: Loop, start: int) -> tuple[float, float, Speed]:
    """Train from step `start` to cfg.train.steps (logging, periodic eval and checkpoints).
    Returns (last train loss, elapsed seconds, steady-state speed).

    Each step's verdict (loss, skipped or not) is read while the next step's work is queued (`train_step`), so
    the host never stops the device between steps: logs and skip messages follow one step behind, and an eval, a
    checkpoint and the end wait for the step before them (`settle`)."""
    t = lp.cfg.train
    ckpt_root = Path(t.output_dir) / "checkpoints"
    lp.start = start
    bad, last_loss, t0 = 0, float("nan"), time.perf_counter()
    t_log, tok_log = t0, 0
    speed, t_step = Speed(skip=steady_skip(lp)), t0
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=console, disable=lp.quiet)

    def account(st: StepStats | None) -> None:
        """A step whose verdict was read: skip messages, the bad-step limit, tokens, logs."""
        nonlocal bad, last_loss, t_log, tok_log
        if st is None:
            return
        progress.update(task, advance=1)
        if st.skipped == "no_targets":
            lp.skipped_no_targets += 1
            lp.say(f"[yellow]step {st.step + 1}: the batch has no target tokens - step skipped "
                   f"({lp.skipped_no_targets} so far)")
            return
        if st.skipped:
            bad += 1
            lp.skipped_nonfinite += 1
            lp.say(f"[yellow]step {st.step + 1}: {_SKIP_WHY[st.skipped]} - step skipped ({bad}/{t.max_bad_steps} "
                   "in a row)")
            if bad >= t.max_bad_steps:
                raise TrainingError(f"{bad} steps in a row with a NaN/Inf loss or gradient norm at step "
                                    f"{st.step + 1}; lower train.lr (it takes effect on resume), enable grad_clip, "
                                    "or check the data and init_from checkpoint")
            return
        bad, last_loss = 0, st.loss
        lp.tokens_done += st.tokens
        tok_log += st.tokens
        if st.step - start >= speed.skip:
            speed.tokens += st.tokens
        progress.update(task, info=f"loss {st.loss:.3f}")
        if _logged(lp, st.step):
            tok_all = lp.run.sum([tok_log])[0]  # the tokens every rank processed, counted
            # from the end of the last logged step (or the loop's start) to this one's, evals and checkpoint
            # writes left out: the steps are read one late, so the time of the read is not the step's own
            _log_train(lp, st.step + 1, st, tok_all / max(st.done_at - t_log, 1e-9), progress)
            t_log, tok_log = st.done_at, 0

    lp.model.train()
    with progress:
        task = progress.add_task("train", total=t.steps, completed=start, info="")
        for step in range(start, t.steps):
            lp.step = step
            account(train_step(lp))
            do_eval = bool(t.eval_every and (step + 1) % t.eval_every == 0 and step + 1 < t.steps)
            do_save = bool(t.save_every and (step + 1) % t.save_every == 0)
            if do_eval or do_save or step == t.steps - 1:
                st = settle(lp)  # this step's queued work belongs to its time
                account(st)
                if st is not None and st.skipped:  # no eval or checkpoint after a skipped step
                    do_eval = do_save = False
            if step - start >= speed.skip:
                speed.seconds += time.perf_counter() - t_step
                speed.steps += 1
            t_pause = time.perf_counter()
            if do_eval:
                lp.logger.log({"kind": "eval", "step": step + 1,
                               "eval_loss": _evaluate(lp, step + 1)})
            if do_save:
                _save(lp, ckpt_root, step + 1)
            t_step = time.perf_counter()  # evals and checkpoint writes stay out of the next step's time
            t_log += t_step - t_pause  # and out of the next logged tokens/s
    lp.step = t.steps
    speed.tokens = int(lp.run.sum([speed.tokens])[0])  # every rank's tokens
    return last_loss, time.perf_counter() - t0, speed


def _mfu(lp: Loop, tps: float | None, attention: bool = False) -> float | None:
    """Model FLOPs utilisation of `tps` tokens/s (every rank's), per GPU, on the 6 N basis (lp.flops_per_token),
    or with attention's own FLOPs added (lp.attention_flops_per_token, one causal sequence of train.seq_len a
    row); None off the GPUs peak_flops knows."""
    peak = peak_flops(lp.run.device)
    if not (peak and tps):
        return None
    fpt = lp.flops_per_token + (lp.attention_flops_per_token if attention else 0)
    return tps * fpt / peak / lp.run.world


def _log_train(lp: Loop, step: int, st: StepStats, tps: float, progress: Progress) -> None:
    device = lp.run.device
    rec = {"kind": "train", "step": step, "loss": st.loss, "lr": lp.sched.get_last_lr()[0],
           "grad_norm": float(st.grad_norm), "tokens_per_s": tps, **{f"aux/{k}": float(v) for k, v in st.aux.items()}}
    mfu = _mfu(lp, tps)
    if mfu is not None:
        rec["mfu"], rec["mfu_with_attention"] = mfu, _mfu(lp, tps, attention=True)
    if device.type == "cuda":
        rec["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    # st.counts / st.drops: every rank's tokens (summed over ranks by _for_log), the load of the whole step
    rec["moe"] = [{"layer": layer, **load_quantiles(c), "drop_rate": float(st.drops[layer]),
                   # raw per-expert counts for `moeadapt simulate-routing` (small models only)
                   **({"counts": [int(x) for x in c.tolist()]} if c.numel() <= 1024 else {})}
                  for layer, c in sorted(st.counts.items())]
    lp.logger.log(rec)
    if not lp.quiet:
        q = " ".join(f"L{m['layer']}(p50 {m['p50']:.2f} p90 {m['p90']:.2f} p99 {m['p99']:.2f} "
                     f"max {m['max']:.2f})" for m in rec["moe"])
        progress.console.print(f"step {step:5d} loss {st.loss:.4f} lr {rec['lr']:.2e} "
                               f"gnorm {float(st.grad_norm):.2f} tok/s {tps:,.0f}  load/mean {q}")


def _resume(lp: Loop) -> int:
    """The step to start from: with cfg.train.resume, that of the first checkpoint of `resume_candidates`
    that loads (saying so when one is skipped), else 0."""
    root = Path(lp.cfg.train.output_dir) / "checkpoints"
    if not lp.cfg.train.resume:
        return 0
    candidates, failed = resume_candidates(root), []
    for ck in candidates:
        try:
            start, sampler_state = lp.run.load(ck, lp.model, lp.opt, lp.sched)
            if lp.copies is not None:
                lp.copies.refresh()
            if not _weights_finite(lp):
                raise ValueError("its weights hold NaN/Inf")
        except (ValueError, FileNotFoundError, OSError) as e:
            failed.append(f"{ck.name}: {e}")
            if ck is not candidates[-1]:
                lp.say(f"[yellow]resume: {ck} does not load ({e}); trying the previous checkpoint")
            continue
        lp.sampler.load_state(sampler_state)
        skipped = ", ".join(f.split(":")[0] for f in failed)
        lp.say(f"resumed from {ck} at step {start}" + (f" (skipped {skipped}, which did not load)" if failed else ""))
        _apply_config_lr(lp, start)
        return start
    if failed:
        raise TrainingError(f"resume: no checkpoint under {root} loads ({'; '.join(failed)}); fix that, start a "
                            "new train.output_dir, or move the checkpoints away")
    lp.say(f"[yellow]resume: no checkpoint under {root}; starting from step 0")
    return 0


def _apply_config_lr(lp: Loop, start: int) -> None:
    """The lr, schedule, betas and weight decay of this run's config take effect from the resumed step (the
    checkpoint's are what the old config gave); a change is stated in the log."""
    t, opt, sched = lp.cfg.train, lp.opt, lp.sched
    old_base, old_lr = sched.base_lrs[0], opt.param_groups[0]["lr"]
    new_lr = t.lr * lr_lambda(lp.cfg)(start)
    for g in opt.param_groups:
        g.update(initial_lr=t.lr, lr=new_lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
    sched.base_lrs = [t.lr] * len(opt.param_groups)
    sched._last_lr = [new_lr] * len(opt.param_groups)
    if not math.isclose(old_lr, new_lr, rel_tol=1e-9, abs_tol=0.0):
        lp.say(f"resume: the lr at step {start} is {new_lr:.3e} from this config (train.lr {t.lr:g} and its "
               f"schedule), not the checkpoint's {old_lr:.3e} (train.lr {old_base:g})")
        lp.logger.log({"kind": "lr_change", "step": start, "lr": new_lr, "checkpoint_lr": old_lr, "train.lr": t.lr})


def _save_fresh_vision_base(cfg: RunConfig, model: HybridMoEModel, out_dir: Path) -> Path | None:
    """A LoRA run of a vision-language model whose tower was initialised here (init_from is a text model, or
    unset) writes that base to out_dir/base before training: the adapter needs the exact frozen tower it was
    trained against, and no other file holds it. Adapter tensors (B = 0 still) are left out."""
    from ..onboard import model_spec_from_dir

    if cfg.lora is None or (cfg.train.init_from and model_spec_from_dir(cfg.train.init_from).vision is not None):
        return None
    state = {k: v for k, v in model.state_dict().items() if ".lora_" not in k and not k.endswith("tokens_per_expert")}
    from ..io import atomic_dir, save_tensors

    with atomic_dir(out_dir / "base") as tmp:
        save_tensors({k: v.detach().float().contiguous() if v.is_floating_point() and "expert_bias" not in k else v
                      for k, v in state.items()}, tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps({"moeadapt": cfg.model.model_dump()}, indent=2))
    return out_dir / "base"


def _final_eval(lp: Loop, step: int, when: str) -> tuple[float, dict | None]:
    """Eval loss (logged and printed); for a multimodal eval set also the answer accuracy."""
    cfg, device = lp.cfg, lp.run.device
    acc = None
    if isinstance(lp.eval_ds, MultimodalDataset):
        r = evaluate_vl(lp.model, lp.eval_ds, cfg.train.micro_batch_size, device, cfg.train.eval_batches,
                        lambda: _autocast(device, cfg.train.dtype))
        loss, acc = r["loss"], {"accuracy": r["accuracy"], **r.get("by_question", {})}
        lp.logger.log({"kind": "eval", "step": step, "eval_loss": loss, "eval_accuracy": r["accuracy"]})
    else:
        loss = _evaluate(lp, step)
        lp.logger.log({"kind": "eval", "step": step, "eval_loss": loss})
    if not lp.quiet:
        extra = "" if acc is None else "  answer accuracy " + " ".join(f"{k} {v:.3f}" for k, v in acc.items())
        console.print(f"eval loss {when}: {loss:.4f}{extra}")
    return loss, acc


def _export(lp: Loop, out_dir: Path) -> None:
    """model/ (sharded safetensors, every rank writing its shards) or adapter/ (gathered, written by rank 0).
    Collective under torchrun."""
    cfg = lp.cfg
    if not _weights_finite(lp):
        raise TrainingError("the trained weights hold NaN/Inf; not exporting them. Lower train.lr and resume from "
                            "the last good checkpoint with train.resume=true")
    if cfg.lora is None:
        # split weights (train.weight_dtype fp32_split) are written whole: fp32, each joined with its low half
        split = isinstance(lp.opt, CopyAdamW) and lp.opt.split_weights
        kw = dict(dtype=torch.float32, value=lp.opt.full_weight) if split else {}
        lp.run.export_model(lp.model, out_dir / "model", {"moeadapt": cfg.model.model_dump(mode="json")},
                            int(cfg.train.export_shard_gb * 1e9), **kw)
        return
    plain = lp.run.adapter_copy(lp.model)  # None on ranks other than 0
    if plain is not None:
        from ..onboard import peft_maps  # checkpoint names / row order for a Hugging Face init_from

        fresh_base = out_dir / "base"  # a vision-language run whose tower started fresh (see _save_fresh_vision_base)
        base = str(fresh_base) if fresh_base.is_dir() else (cfg.train.init_from or cfg.model.name)
        export_peft(plain, cfg.lora, out_dir / "adapter", base_model=base,
                    **peft_maps(cfg.train.init_from))


def train(cfg: RunConfig, quiet: bool = False) -> TrainResult:
    run = start_run(cfg)
    cfg = resolve_weight_dtype(cfg, run, run.device)  # train.weight_dtype auto -> fp32_split or fp32
    t = cfg.train
    graphed, no_graph = resolve_cuda_graph(cfg, run)  # auto: where the run allows it; true: refused if it cannot
    why = why_not_bf16(cfg, run, run.device)  # before the model is built
    if why:
        raise TrainingError(why)
    quiet = quiet or not run.is_main
    torch.manual_seed(t.seed)
    out_dir = Path(t.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if run.is_main:
        for p in clean_partial_saves(out_dir / "checkpoints"):
            console.print(f"[yellow]removed {p.name}, left by an interrupted save")
    tok = get_tokenizer(cfg.data.tokenizer, t.init_from)
    if tok.vocab_size > cfg.model.vocab_size:
        raise TrainingError(f"tokenizer has {tok.vocab_size} tokens but model.vocab_size={cfg.model.vocab_size}; "
                            "raise vocab_size or use a matching tokenizer")
    vl = cfg.model.vision is not None
    if vl and cfg.data.pack_documents:
        raise TrainingError("data.pack_documents keeps packed text documents apart, but a vision-language model "
                            "reads one record per row; set data.pack_documents: false")
    if vl:  # image + text records, one per row (data/multimodal.py)
        train_ds, eval_ds = build_mm_datasets(cfg.data, tok, cfg.model.vision, t.seq_len)
        if train_ds.skipped and not quiet:
            console.print(f"[yellow]skipped {len(train_ds.skipped)} records with bad images (data.skip_bad_images); "
                          f"first: {train_ds.skipped[0]}")
    else:
        train_ds, eval_ds = build_datasets(cfg.data, tok, t.seq_len, t.seed)
    model = build_meta(cfg, run.device)  # counted on meta, before it is sharded
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fpt, n_total = flops_per_token(model, cfg), count_parameters(model, cfg.model)["total"]
    materialize_shards(model, cfg, run)  # parallelize on meta, allocate and fill this rank's shards, init_from
    if vl and run.is_main:
        _save_fresh_vision_base(cfg, model, out_dir)
    params = [p for p in model.parameters() if p.requires_grad]
    opt, copies = make_optimizer(cfg, run, model, params)  # AdamW, fused on CUDA, on local shards under FSDP
    lp = Loop(cfg, run, model, params, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)),
              (MultimodalSampler if vl else Sampler)(train_ds, t.micro_batch_size, t.seed, rank=run.data_rank,
                                                     world=run.data_world),
              MetricsLogger(out_dir, t.tensorboard) if run.is_main else NullLogger(), eval_ds, fpt, quiet,
              copies=copies)
    if graphed:
        use_cuda_graph(lp)
    start = _resume(lp)
    lp.logger.truncate_after(start)  # a resumed run continues the log from its checkpoint step
    if start:
        lp.logger.log({"kind": "resume", "step": start})
    with _run_errors(lp):
        return _train_body(lp, start, out_dir, n_train, n_total, len(train_ds), quiet, no_graph)


@contextlib.contextmanager
def _run_errors(lp: Loop):
    """Ctrl-C and a full disk end the run with one message: the step and the checkpoint to resume from."""
    root = Path(lp.cfg.train.output_dir) / "checkpoints"

    def newest() -> str:
        ck = latest_checkpoint(root)
        return f"the newest checkpoint is {ck}" if ck else "no checkpoint was saved (set train.save_every)"

    try:
        yield
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"interrupted at step {lp.step + 1} of {lp.cfg.train.steps}; {newest()} - resume "
                                "with train.resume=true") from None
    except Exception as e:
        full = (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or "No space left" in str(e)
        if not full:
            raise
        where = getattr(e, "filename", None) or "the output directory"
        raise TrainingError(f"disk full while writing {where} at step {lp.step + 1}; {newest()} - free space and "
                            "resume with train.resume=true") from None


def _why_not_replayed(lp: Loop, no_graph: str | None) -> str | None:
    """Why the run's last steps were not replayed from a CUDA graph (None: they were)."""
    if lp.graph_released:
        return lp.graph_released
    if lp.graph is None:
        return no_graph
    if lp.graph.graph is None:
        return f"the run ended within its {GRAPH_WARMUP} eager warm-up steps, before the capture"
    return None


def _train_body(lp: Loop, start: int, out_dir: Path, n_train: int, n_total: int, n_rows: int,
                quiet: bool, no_graph: str | None) -> TrainResult:
    cfg, t, run = lp.cfg, lp.cfg.train, lp.run
    if not quiet:
        console.print(f"[bold]{cfg.model.name}[/]: {n_total / 1e6:.2f}M params, "
                      f"{n_train / 1e6:.3f}M trainable ({'LoRA' if cfg.lora else 'full'}), device {run.device}, "
                      f"{n_rows} train rows x {t.seq_len} tokens")
        if run.device.type == "cuda" and run.world == 1:  # one GPU: say which step
            why = why_not_copies(cfg, run, run.device, lp.model)
            trained = "adapters" if cfg.lora else "weights"
            if t.weight_dtype == "bf16":
                console.print("weights: bf16 (train.weight_dtype), updated in fp32 and stored stochastically rounded")
            elif t.weight_dtype == "fp32_split":
                console.print("weights: fp32, split (train.weight_dtype): the matmuls read the bf16 high halves, "
                              "the optimizer keeps the low 16 bits")
            else:
                console.print(f"{trained}: fp32, " + ("the matmuls read bf16 copies (train.weight_copies)" if lp.copies
                                                      else "cast to bf16 at each use (no weight copies: "
                                                      f"{why or 'no trainable matmul weight to copy'})"))
            console.print(f"step: captured as a CUDA graph after {GRAPH_WARMUP} eager steps, then replayed "
                          "(train.cuda_graph)" if lp.graph else f"step: eager ({no_graph})")
    eval_before, acc_before = _final_eval(lp, start, "before")

    last_loss, elapsed, speed = fit(lp, start)

    eval_after, acc_after = _final_eval(lp, t.steps, "after")
    lp.logger.close()
    tps = run.sum([lp.tokens_done])[0] / max(elapsed, 1e-9)
    mfu, mfu_attn = _mfu(lp, speed.tokens_per_s), _mfu(lp, speed.tokens_per_s, attention=True)
    _export(lp, out_dir)
    if run.is_main:
        plot_report(lp.logger.path, out_dir / "report.png", title=f"{cfg.model.name} - {'LoRA' if cfg.lora else 'full'}")
        summary = {"eval_loss_before": eval_before, "eval_loss_after": eval_after, "final_train_loss": last_loss,
                   # wall clock over the loop (first steps' compiles and periodic evals included)
                   "tokens_per_s": tps,
                   # the training speed: train steps only, after the first STEADY_SKIP (and a CUDA graph's
                   # capture: steady_skip), None if too few steps
                   "tokens_per_s_steady": speed.tokens_per_s, "steady_steps": speed.steps,
                   # the steady speed as a fraction of the GPU's bf16 peak (None off the H100 / H200): FLOPs per
                   # token = 6 x the active non-embedding parameters, 2/3 of that under LoRA (no weight gradients
                   # of the frozen base); the second adds attention's own FLOPs (scores, delta-rule state) for
                   # one causal sequence of seq_len a row
                   "mfu_steady": mfu, "flops_per_token": lp.flops_per_token,
                   "mfu_steady_with_attention": mfu_attn,
                   "attention_flops_per_token": lp.attention_flops_per_token,
                   "steps": t.steps, "elapsed_s": elapsed, "trainable_params": n_train,
                   "skipped_nonfinite_steps": lp.skipped_nonfinite, "skipped_no_target_steps": lp.skipped_no_targets,
                   "weight_copies": lp.copies is not None, "weight_dtype": t.weight_dtype,
                   # the steps replayed from a CUDA graph (train.cuda_graph), or why they ran eagerly
                   "cuda_graph": lp.graph is not None and lp.graph.graph is not None,
                   "cuda_graph_off": _why_not_replayed(lp, no_graph)}
        if acc_before is not None:
            summary.update(eval_accuracy_before=acc_before, eval_accuracy_after=acc_after)
        atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=2))
    run.finish()
    if not quiet:
        steady = (f"{speed.tokens_per_s:,.0f} tokens/s steady state (train steps after the first {speed.skip}"
                  f"{f'; {mfu:.1%} MFU, {mfu_attn:.1%} counting attention' if mfu else ''}), "
                  if speed.tokens_per_s else "")
        console.print(f"eval loss before {eval_before:.4f} -> after {eval_after:.4f}; {steady}{tps:,.0f} tokens/s "
                      f"wall clock (compiles and evals included); results in {out_dir}/")
    return TrainResult(out_dir, eval_before, eval_after, last_loss, tps, t.steps, acc_before, acc_after,
                       speed.tokens_per_s)
